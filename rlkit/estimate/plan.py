"""What makes a plan fit (the single changes that lower its peak), the report, the command and
the check every launch on an accelerator runs."""

from __future__ import annotations

import re
from typing import Any

from rlkit.errors import UserError
from rlkit.estimate.arch import Arch, config_json
from rlkit.estimate.memory import (
    GIB,
    Hardware,
    MemoryModel,
    devices_needed,
    estimate,
    gib,
    verdicts,
    width_bytes,
)
from rlkit.recipe import changed


def _zero3(cfg: Any, _hardware: Hardware) -> tuple[str, Any]:
    return "deepspeed.zero_stage=3", changed(cfg, {"deepspeed.zero_stage": 3})


def _offload(cfg: Any, _hardware: Hardware) -> tuple[str, Any]:
    values = {"deepspeed.offload_optimizer": True, "deepspeed.zero_stage": max(cfg.deepspeed.zero_stage, 2)}
    return "deepspeed.offload_optimizer=true", changed(cfg, values)


def _checkpointing(cfg: Any, _hardware: Hardware) -> tuple[str, Any]:
    return "model.gradient_checkpointing=true", changed(cfg, {"model.gradient_checkpointing": True})


SHARED = (_zero3, _offload, _checkpointing)  # the changes every stage's plan can take, as its memory model's are


def fixes(cfg: Any, memory: MemoryModel, arch: Arch, hardware: Hardware) -> list[tuple[str, float, bool]]:
    """Each single change that lowers the largest process's peak (or the devices taken, when the
    hardware has too few): (change, its new peak, whether the plan then fits). The changes: the
    ones every stage shares, then the stage's own (its memory model's)."""
    before = max(p.total for p in estimate(cfg, memory, arch, hardware))
    need = devices_needed(cfg, memory)
    out = []
    for change in (*SHARED, *memory.changes):
        try:
            made = change(cfg, hardware)
        except (TypeError, ValueError, AttributeError, UserError):  # a change this recipe cannot take
            made = None
        if made is None or made[1] == cfg:
            continue
        label, after = made
        processes = estimate(after, memory, arch, hardware)
        peak, takes = max(p.total for p in processes), devices_needed(after, memory)
        if peak < before * 0.98 or takes < need > hardware.devices:
            fits = all(ok for _, ok, _ in verdicts(processes, hardware)) and takes <= hardware.devices
            out.append((label, peak, fits))
    return out


def report(cfg: Any, memory: MemoryModel, arch: Arch, source: str, hardware: Hardware | None) -> list[str]:
    """The estimate as the console shows it."""
    width = width_bytes(cfg.model.dtype, hardware)
    count = f"{arch.params / 1e9:.2f}B" if arch.params >= 1e9 else f"{arch.params / 1e6:.2f}M"
    lines = [f"{arch.name}: {count} parameters ({source}); {cfg.finetuning} fine-tuning, "
             f"{cfg.model.dtype if cfg.model.dtype != 'auto' else {2: 'bf16', 4: 'fp32'}[width]}, "
             f"ZeRO-{cfg.deepspeed.zero_stage}"]
    lines += _vision_lines(cfg, memory, arch)
    processes = estimate(cfg, memory, arch, hardware)
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
    need = devices_needed(cfg, memory)
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
        options = fixes(cfg, memory, arch, hardware)
        if options:
            lines.append("  changes that lower the peak (each alone):")
            lines += [f"    {label}: peak {gib(peak)}{' (fits)' if fits else ''}" for label, peak, fits in options]
    return lines


def _vision_lines(cfg: Any, memory: MemoryModel, arch: Arch) -> list[str]:
    """What a vision-language model adds: its vision tower and projector, whether they train, and
    the image tokens one image takes of the context the estimate counts (none for a text model)."""
    v, m = arch.vision, cfg.model
    if v is None:
        return []

    def size(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    state = lambda frozen: "frozen" if frozen else "trained"  # noqa: E731
    context = memory.context
    tokens = (f"{v.tokens_per_image} image tokens per image, inside {context}" if v.tokens_per_image else
              f"image tokens per image depend on its size (inside {context})")
    return [f"  vision tower {size(v.tower)} ({state(m.freeze_vision_tower)}), projector {size(v.projector)} "
            f"({state(m.freeze_multi_modal_projector)}), language model {size(arch.language_params)}; {tokens}"]


def check_before_launch(cfg: Any, memory: MemoryModel, device: Any) -> str | None:
    """On an accelerator, the one line that says the plan does not fit its devices (None when it
    fits, on a CPU, or when the model's config.json cannot be read here)."""
    if not device.is_accelerator or cfg.memory_check == "off" or not device.total_memory_bytes:
        return None
    try:
        config, _ = config_json(cfg.model.path)
        arch = Arch.from_config(config, cfg.model.path)
    except UserError:
        return None
    size = device.total_memory_bytes / GIB
    name = re.sub(r"[^A-Za-z0-9]", "", device.device_name.split()[-1]) or device.kind
    hardware = Hardware(f"{device.device_count}x{name}-{size:.0f}G", 1, device.device_count, name, size, device.bf16)
    over = [(p, -room) for p, ok, room in verdicts(estimate(cfg, memory, arch, hardware), hardware) if not ok]
    if not over:
        return None
    p, excess = max(over, key=lambda x: x[1])
    return (f"memory: a {p.kind} needs about {gib(p.total)}, {gib(excess)} more than a {size:.0f} GiB device "
            f"gives it (an estimate: rlkit estimate RECIPE --hardware {hardware.spec} shows the parts and the "
            "changes that fit)")
