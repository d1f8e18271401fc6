"""What a teacher must share with its student before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError


def check_teacher(teacher: Any, student_tokenizer: str, device: Any) -> None:
    """Before launch: the teacher's precision on this device, its kernels, and its tokenizer (the
    student's, `student_tokenizer`); its path is checked with every model the recipe names
    (`rlkit.models.check_model`)."""
    from rlkit.accel import check_precision
    from rlkit.kernels import check_kernels
    from rlkit.models import model_config

    check_precision(teacher.dtype, device, "distill.teacher.dtype")
    check_kernels(teacher, device, model_config(teacher).model_type, "distill.teacher.kernels")
    check_same_tokenizer(student_tokenizer, teacher.tokenizer or teacher.path)


def check_distill(cfg: Any, device: Any) -> None:
    """A stage check before launch (`driver.prepare_inputs`): a recipe's `distill.teacher`, if it
    has one, against the student (`model`) and the device."""
    if cfg.distill is not None:
        check_teacher(cfg.distill.teacher, cfg.model.tokenizer or cfg.model.path, device)


def check_teacher_node(distill: Any) -> None:
    """Once Ray is up: the node `distill.node` names is one of the cluster's (one line otherwise)."""
    from rlkit.engine.cluster import cluster_nodes

    if distill is None or not distill.node:
        return
    nodes = [name.rstrip("'") for name in cluster_nodes()]
    if distill.node not in nodes:
        raise ConfigError(f"{distill.node} is not a node of this Ray cluster (its nodes: {', '.join(nodes)}): give "
                          "one of those addresses, or null to let Ray place the teacher", "distill.node")


def check_same_tokenizer(student: str | Path, teacher: str | Path, key: str = "distill.teacher") -> None:
    """One line unless the two model directories tokenize alike: the same vocabulary (every token
    at the same id) and the same special tokens. The teacher scores the student's token ids, so
    another tokenizer would score other text."""
    from transformers import AutoTokenizer

    s, t = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(str(teacher))
    vs, vt = s.get_vocab(), t.get_vocab()
    if vs != vt:
        only = sorted(set(vs.items()) ^ set(vt.items()), key=lambda kv: kv[1])[0]
        where = "student" if only in vs.items() else "teacher"
        raise ConfigError(f"the teacher {teacher} and the student {student} have other tokenizers ({len(vt)} and "
                          f"{len(vs)} tokens; token {only[0]!r} is id {only[1]} in the {where}'s only): on-policy "
                          "distillation needs one tokenizer (choose a teacher of the student's family)", key)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(s, name) != getattr(t, name):
            raise ConfigError(f"the teacher {teacher} and the student {student} differ in {name} ({getattr(t, name)} "
                              f"vs {getattr(s, name)}): on-policy distillation needs one tokenizer", key)


class TeacherWorker:
    """The teacher in a Ray actor of its own (`distill.placement: actor`): one device, or CPUs,
    on any node or `distill.node`. It scores each step's samples once; the driver puts the
    logprobs into the batch (`GRPOBatch.teacher_logp`) before the learners train."""

    def __init__(self, model: Any, device: str):
        from rlkit import models
        from rlkit.accel import apply_env, configure_cpu_threads, detect
        from rlkit.console import name_worker_log
        from rlkit.engine.logprobs import Reference
        from rlkit.kernels import with_kernels

        name_worker_log("teacher")
        info = detect(device)
        apply_env(info)
        if not info.is_accelerator:
            configure_cpu_threads()
        dtype = models.resolve_dtype(model.dtype, info.bf16 and info.is_accelerator)
        self.device = info.torch_device
        # frozen and scored as the learner's reference and teacher copies are
        self.teacher = Reference(None, "full", lambda: with_kernels(models.load_frozen(model, dtype, self.device),
                                                                    model.kernels, info.kind))

    def ready(self) -> str:
        """The node this teacher runs on (its address), once its model is loaded."""
        import ray

        return ray.util.get_node_ip_address()

    def logprobs(self, micro_batches: list[dict[str, Any]], temperature: float) -> list[Any]:
        """Token logprobs [b, l-1] (CPU) at each micro-batch's completion positions."""
        out = []
        for mb in micro_batches:
            mb = {k: v.to(self.device) for k, v in mb.items()}
            out.append(self.teacher.logprobs(mb, temperature, mb["completion_mask"][:, 1:].bool()).cpu())
        return out


class TeacherActor:
    """The driver's handle on a `TeacherWorker`: `score(batch)` returns the batch with the teacher's
    logprobs attached."""

    def __init__(self, distill: Any, device: Any, ray_cfg: Any, rows_per_call: int):
        import ray

        from rlkit.engine.calls import name_actor, wait_all
        from rlkit.engine.placement import actor_resources, worker_env

        opts = actor_resources(device, ray_cfg.cpus_per_actor, custom=ray_cfg.resources.teacher)
        if distill.node:  # Ray's per-node resource pins the actor to that node
            opts["resources"] = {**opts.get("resources", {}), f"node:{distill.node}": 0.001}
        self.actor = ray.remote(TeacherWorker).options(**opts, runtime_env={"env_vars": worker_env(device)}).remote(
            distill.teacher, device.kind)
        name_actor(self.actor, "the teacher")
        self.rows = rows_per_call
        self.node = wait_all([self.actor.ready.remote()], ["the teacher"], "its start")[0]

    def score(self, batch: Any, temperature: float) -> Any:
        """`batch` (a `GRPOBatch`) with `teacher_logp` [B, L-1]."""
        import dataclasses

        import torch

        from rlkit.engine.calls import wait_all

        spans = [range(i, min(i + self.rows, len(batch))) for i in range(0, len(batch), self.rows)]
        chunks = [{k: v for k, v in batch.micro_batch(list(rows)).items()
                   if k in ("input_ids", "attention_mask", "completion_mask")} for rows in spans]
        scored = wait_all([self.actor.logprobs.remote(chunks, temperature)], ["the teacher"], "scoring")[0]
        logp = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for rows, part in zip(spans, scored):
            logp[rows.start:rows.stop, :part.shape[1]] = part
        return dataclasses.replace(batch, teacher_logp=logp)

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)
