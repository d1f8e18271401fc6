"""GRPO's memory model (`rlkit estimate`, the check before launch): its learner ranks, rollout
engines (apart, or hosted by the learners), a distillation teacher (its own actor, or a copy
beside each learner rank), and the changes of its own that may make a plan fit
(`rlkit.estimate.memory.MemoryModel`)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

from rlkit.estimate.arch import Arch, config_json
from rlkit.estimate.memory import (
    CPU_RUNTIME,
    LOGITS_CHUNK,
    Hardware,
    MemoryModel,
    Process,
    colocated,
    context_bytes,
    engine_process,
    learner_process,
    width_bytes,
)
from rlkit.recipe import changed

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "auto", "fp32": "fp32", "bf16": "bf16"}


def _processes(cfg: Any, arch: Arch, hardware: Hardware | None) -> list[Process]:
    g, r = cfg.grpo, cfg.rollout
    width, ctx = width_bytes(cfg.model.dtype, hardware), context_bytes(hardware)
    learner = learner_process(cfg, arch, width, g.num_learners, g.micro_batch_size * r.max_model_len, ctx,
                              reference=g.beta > 0 and cfg.finetuning == "full",
                              sync_bytes=0.0 if r.colocate else r.sync_bucket_mib * 2**20)
    learner, teacher = _teacher(cfg, learner, hardware)
    seqs = math.ceil(g.prompts_per_step * g.group_size / (g.num_learners if r.colocate else r.num_engines))
    engine = engine_process(arch, width, r, seqs, ctx)
    apart = ([teacher] if teacher is not None else []) + _served_rewards(cfg, hardware)
    if not r.colocate:
        return [learner, engine, *apart]
    return [colocated(learner, engine, r.sleep, hardware), *apart]


def _served(cfg: Any) -> list[tuple[str, dict[str, Any]]]:
    """(recipe key, `memory_parts()`) of each reward that serves a model of its own in Ray actors
    (`rewards.model:RewardModel` with `ray_actor`, `rewards.llm_judge:LLMJudge`): a class importable
    by its `module:Class` name whose instance says what it holds. A reward of a file beside the
    recipe, or one that cannot be built here, is not counted."""
    import importlib

    out = []
    for i, spec in enumerate(cfg.rewards):
        module, _, name = spec.fn.partition(":")
        try:
            parts = getattr(importlib.import_module(module), name)(**spec.args).memory_parts()
        except Exception:  # noqa: BLE001 — not a served model's reward, or not importable here
            continue
        if parts.get("actors"):
            out.append((f"rewards[{i}]", parts))
    return out


def _served_rewards(cfg: Any, hardware: Hardware | None) -> list[Process]:
    """A served reward model (its weights and one batch's activations) or an LLM judge's vLLM
    engines (as the policy's are counted, for the step's samples); on a CPU kind, host memory."""
    out = []
    for key, p in _served(cfg):
        arch = Arch.from_config(*config_json(p["path"]))
        on_cpu = p["device"] == "cpu" or hardware is None
        width = width_bytes(DTYPES.get(p["dtype"], "auto"), None if on_cpu else hardware)
        ctx = 0.0 if on_cpu else context_bytes(hardware)
        if p["kind"] == "engine":
            r = SimpleNamespace(tensor_parallel_size=1, max_model_len=p["max_model_len"], num_engines=p["actors"],
                                kv_cache_gib=p["kv_cache_gib"], gpu_memory_utilization=p["gpu_memory_utilization"],
                                colocate=True, sync_bucket_mib=0)
            seqs = math.ceil(cfg.grpo.prompts_per_step * cfg.grpo.group_size / p["actors"])
            proc = dataclasses.replace(engine_process(arch, width, r, seqs, ctx), kind=f"LLM judge engine ({key})")
        else:
            parts = {"weights": arch.params * width,
                     "activations of a batch": p["tokens"] * (4 * arch.hidden + 2 * arch.intermediate) * width,
                     "context" if ctx else "runtime (CPU)": ctx or CPU_RUNTIME}
            proc = Process(f"reward model ({key})", p["actors"], parts)
        out.append(dataclasses.replace(proc, parts={}, host=proc.parts, budget=None) if on_cpu and hardware else proc)
    return out


def _teacher(cfg: Any, learner: Process, hardware: Hardware | None) -> tuple[Process, Process | None]:
    """The frozen distillation teacher, whole: its own process (placement: actor), or a copy in
    each learner rank (and with `loss: jsd` its chunk of logits beside the student's)."""
    d = cfg.distill
    if d is None:
        return learner, None
    t_arch, t_width = Arch.from_config(*config_json(d.teacher.path)), width_bytes(d.teacher.dtype, hardware)
    tokens = cfg.grpo.micro_batch_size * cfg.rollout.max_model_len
    logits = min(tokens * t_arch.vocab, LOGITS_CHUNK) * (t_width + 8)  # no gradient
    if d.placement == "actor":  # its own process: weights, one chunk of logits, the context
        parts = {"parameters": t_arch.params * t_width, "logits": logits, "context": context_bytes(hardware)}
        return learner, Process("teacher", 1, parts)
    last = [k for k in learner.parts if k == "context" or k.startswith("runtime")]
    parts = {k: v for k, v in learner.parts.items() if k not in last}
    parts["teacher copy"] = t_arch.params * t_width
    if d.loss == "jsd":
        parts["teacher logits"] = logits
    return dataclasses.replace(learner, parts={**parts, **{k: learner.parts[k] for k in last}}), None


def _devices(cfg: Any) -> int:
    r, d = cfg.rollout, cfg.distill
    teacher = 1 if d is not None and d.placement == "actor" else 0  # the teacher's own device
    served = sum(p["actors"] for _, p in _served(cfg) if p["device"] != "cpu")  # one device each
    return cfg.grpo.num_learners + (0 if r.colocate else r.num_engines * r.tensor_parallel_size) + teacher + served


def _half_micro_batch(cfg: Any, _hardware: Hardware) -> tuple[str, Any] | None:
    n = cfg.grpo.micro_batch_size
    return None if n < 2 else (f"grpo.micro_batch_size={n // 2}", changed(cfg, {"grpo.micro_batch_size": n // 2}))


def _wider_engines(cfg: Any, _hardware: Hardware) -> tuple[str, Any] | None:
    tp = 2 * cfg.rollout.tensor_parallel_size
    return f"rollout.tensor_parallel_size={tp}", changed(cfg, {"rollout.tensor_parallel_size": tp})


def _engines_apart(cfg: Any, _hardware: Hardware) -> tuple[str, Any] | None:
    return ("rollout.colocate=false", changed(cfg, {"rollout.colocate": False})) if cfg.rollout.colocate else None


def _engines_colocated(cfg: Any, _hardware: Hardware) -> tuple[str, Any] | None:
    if cfg.rollout.colocate:
        return None
    values = {"rollout.colocate": True, "rollout.num_engines": cfg.grpo.num_learners, "rollout.tensor_parallel_size": 1}
    return "rollout.colocate=true", changed(cfg, values)


def _fit_devices(cfg: Any, hardware: Hardware) -> tuple[str, Any] | None:
    """The plan on the devices the hardware has: fewer learners and engines, or all colocated on one."""
    have, r = hardware.devices, cfg.rollout
    if _devices(cfg) <= have:
        return None
    if r.colocate or have < 2:
        after = changed(cfg, {"grpo.num_learners": have, "rollout.colocate": True, "rollout.num_engines": have})
        return f"grpo.num_learners={have} rollout.colocate=true", after
    engines = max(1, min(r.num_engines, (have // 2) // r.tensor_parallel_size))
    learners = have - engines * r.tensor_parallel_size
    after = changed(cfg, {"grpo.num_learners": learners, "rollout.num_engines": engines})
    return f"grpo.num_learners={learners} rollout.num_engines={engines}", after


MEMORY = MemoryModel(_processes, _devices,
                     (_half_micro_batch, _wider_engines, _engines_apart, _engines_colocated, _fit_devices),
                     "rollout.max_model_len")
