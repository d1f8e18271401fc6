"""What makes a plan fit (the single changes that lower its peak), the report, the command and
the check every launch on an accelerator runs."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from rlkit.errors import UserError
from rlkit.estimate.arch import Arch, model_config
from rlkit.estimate.memory import GIB, Hardware, devices_needed, estimate, gib, verdicts, width_bytes

FIXES = (  # (what to write, how it changes the config)
    ("deepspeed.zero_stage=3", lambda c: _set(c, "deepspeed", zero_stage=3)),
    ("deepspeed.offload_optimizer=true", lambda c: _set(c, "deepspeed", offload_optimizer=True,
                                                        zero_stage=max(c.deepspeed.zero_stage, 2))),
    ("model.gradient_checkpointing=true", lambda c: _set(c, "model", gradient_checkpointing=True)),
    ("half the micro-batch, twice the accumulation", lambda c: _half_micro_batch(c)),
    ("rollout.tensor_parallel_size x2", lambda c: _set(c, "rollout", tensor_parallel_size=2 *
                                                       c.rollout.tensor_parallel_size) if hasattr(c, "rollout")
     else None),
    ("rollout.colocate=false", lambda c: _set(c, "rollout", colocate=False)
     if hasattr(c, "rollout") and c.rollout.colocate else None),
    ("rollout.colocate=true", lambda c: _set(c, "rollout", colocate=True, num_engines=c.grpo.num_learners,
                                             tensor_parallel_size=1)
     if hasattr(c, "rollout") and not c.rollout.colocate else None),
)


def fixes(cfg: Any, stage: str, arch: Arch, hardware: Hardware) -> list[tuple[str, float, bool]]:
    """Each single change that lowers the largest process's peak (or the devices taken, when the
    hardware has too few): (change, its new peak, whether the plan then fits)."""
    before = max(p.total for p in estimate(cfg, stage, arch, hardware))
    out = []
    for label, change in (*FIXES, ("the devices there are", lambda c: _fit_devices(c, stage, hardware))):
        try:
            changed = change(cfg)
        except (TypeError, ValueError, AttributeError, UserError):  # a change this recipe cannot take
            changed = None
        if changed is None or changed == cfg:
            continue
        processes = estimate(changed, stage, arch, hardware)
        peak = max(p.total for p in processes)
        fewer = devices_needed(changed, stage) < devices_needed(cfg, stage) > hardware.devices
        if peak < before * 0.98 or fewer:
            fits = all(ok for _, ok, _ in verdicts(processes, hardware))
            fits &= devices_needed(changed, stage) <= hardware.devices
            if label.startswith("half") and stage == "sft":
                label = (f"train.micro_batch_size={changed.train.micro_batch_size} "
                         f"train.grad_accum={changed.train.grad_accum}")
            elif label.startswith("half"):
                label = f"grpo.micro_batch_size={changed.grpo.micro_batch_size}"
            elif label == "the devices there are" and stage == "sft":
                label = f"train.num_learners={changed.train.num_learners}"
            elif label == "the devices there are":
                label = (f"grpo.num_learners={changed.grpo.num_learners} rollout.colocate=true" if
                         changed.rollout.colocate else f"grpo.num_learners={changed.grpo.num_learners} "
                         f"rollout.num_engines={changed.rollout.num_engines}")
            elif label.startswith("rollout.tensor"):
                label = f"rollout.tensor_parallel_size={changed.rollout.tensor_parallel_size}"
            out.append((label, peak, fits))
    return out


def _set(cfg: Any, section: str, **values: Any) -> Any:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def _fit_devices(cfg: Any, stage: str, hardware: Hardware) -> Any:
    """The plan on the devices the hardware has (fewer learners; GRPO on one device: colocated)."""
    have = hardware.devices
    if devices_needed(cfg, stage) <= have:
        return None
    if stage == "sft":
        return _set(cfg, "train", num_learners=have)
    r = cfg.rollout
    if r.colocate or have < 2:
        return _set(_set(cfg, "grpo", num_learners=have), "rollout", colocate=True, num_engines=have)
    engines = max(1, min(r.num_engines, (have // 2) // r.tensor_parallel_size))
    return _set(_set(cfg, "grpo", num_learners=have - engines * r.tensor_parallel_size), "rollout",
                num_engines=engines)


def _half_micro_batch(cfg: Any) -> Any:
    if hasattr(cfg, "train"):
        t = cfg.train
        if t.micro_batch_size < 2:
            return None
        return _set(cfg, "train", micro_batch_size=t.micro_batch_size // 2, grad_accum=t.grad_accum * 2)
    g = cfg.grpo
    return None if g.micro_batch_size < 2 else _set(cfg, "grpo", micro_batch_size=g.micro_batch_size // 2)


def report(cfg: Any, stage: str, arch: Arch, source: str, hardware: Hardware | None) -> list[str]:
    """The estimate as the console shows it."""
    width = width_bytes(cfg.model.dtype, hardware)
    count = f"{arch.params / 1e9:.2f}B" if arch.params >= 1e9 else f"{arch.params / 1e6:.2f}M"
    lines = [f"{arch.name}: {count} parameters ({source}); {cfg.finetuning} fine-tuning, "
             f"{cfg.model.dtype if cfg.model.dtype != 'auto' else {2: 'bf16', 4: 'fp32'}[width]}, "
             f"ZeRO-{cfg.deepspeed.zero_stage}"]
    lines += _vision_lines(cfg, stage, arch)
    processes = estimate(cfg, stage, arch, hardware)
    for p in processes:
        lines.append(f"{p.kind} (x{p.count}){': ' + p.note if p.note else ''}")
        for part, size in p.parts.items():
            if size or part not in p.host:
                lines.append(f"  {part:<34} {gib(size):>10}")
        lines.append(f"  {'total':<34} {gib(p.total):>10}")
        if p.host:
            lines.append(f"  offloaded to host memory: {gib(sum(p.host.values()))} per rank "
                         f"({', '.join(p.host)})")
    if hardware is None:
        return lines
    need = devices_needed(cfg, stage)
    lines.append(f"on {hardware.spec} ({hardware.devices} devices of {hardware.gib:g} GiB):")
    if need > hardware.devices:
        lines.append(f"  the plan takes {need} devices, the hardware has {hardware.devices}")
    all_fit = need <= hardware.devices
    for p, ok, headroom in verdicts(processes, hardware):
        share = f" of the {p.budget:g} x {hardware.gib:g} GiB vLLM takes" if p.budget else f" of {hardware.gib:g} GiB"
        verdict = f"fits, {gib(headroom)} to spare" if ok else f"does NOT fit: {gib(-headroom)} over"
        lines.append(f"  {p.kind}: {gib(p.total)}{share}: {verdict}")
        all_fit &= ok
    if not all_fit:
        options = fixes(cfg, stage, arch, hardware)
        if options:
            lines.append("  changes that lower the peak (each alone):")
            lines += [f"    {label}: peak {gib(peak)}{' (fits)' if fits else ''}" for label, peak, fits in options]
    return lines


def _vision_lines(cfg: Any, stage: str, arch: Arch) -> list[str]:
    """What a vision-language model adds: its vision tower and projector, whether they train, and
    the image tokens one image takes of the context the estimate counts (none for a text model)."""
    v, m = arch.vision, cfg.model
    if v is None:
        return []

    def size(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    state = lambda frozen: "frozen" if frozen else "trained"  # noqa: E731
    context = "data.cutoff_len" if stage == "sft" else "rollout.max_model_len"
    tokens = (f"{v.tokens_per_image} image tokens per image, inside {context}" if v.tokens_per_image else
              f"image tokens per image depend on its size (inside {context})")
    return [f"  vision tower {size(v.tower)} ({state(m.freeze_vision_tower)}), projector {size(v.projector)} "
            f"({state(m.freeze_multi_modal_projector)}), language model {size(arch.language_params)}; {tokens}"]


def check_before_launch(cfg: Any, stage: str, device: Any) -> str | None:
    """On an accelerator, the one line that says the plan does not fit its devices (None when it
    fits, on a CPU, or when the model's config.json cannot be read here)."""
    if not device.is_accelerator or cfg.memory_check == "off" or not device.total_memory_bytes:
        return None
    try:
        config, _ = model_config(cfg.model.path)
        arch = Arch.from_config(config, cfg.model.path)
    except UserError:
        return None
    size = device.total_memory_bytes / GIB
    name = re.sub(r"[^A-Za-z0-9]", "", device.device_name.split()[-1]) or device.kind
    hardware = Hardware(f"{device.device_count}x{name}-{size:.0f}G", 1, device.device_count, name, size, device.bf16)
    over = [(p, -room) for p, ok, room in verdicts(estimate(cfg, stage, arch, hardware), hardware) if not ok]
    if not over:
        return None
    p, excess = max(over, key=lambda x: x[1])
    return (f"memory: a {p.kind} needs about {gib(p.total)}, {gib(excess)} more than a {size:.0f} GiB device "
            f"gives it (an estimate: rlkit estimate RECIPE --hardware {hardware.spec} shows the parts and the "
            "changes that fit)")
