"""SFT's memory model (`rlkit estimate`, the check before launch): its learner ranks, and the
changes of its own that may make a plan fit (`rlkit.estimate.memory.MemoryModel`)."""

from __future__ import annotations

from typing import Any

from rlkit.estimate.arch import Arch
from rlkit.estimate.memory import Hardware, MemoryModel, Process, context_bytes, learner_process, width_bytes
from rlkit.recipe import changed


def _processes(cfg: Any, arch: Arch, hardware: Hardware | None) -> list[Process]:
    t = cfg.train
    return [learner_process(cfg, arch, width_bytes(cfg.model.dtype, hardware), t.num_learners,
                            t.micro_batch_size * cfg.data.cutoff_len, context_bytes(hardware), reference=False)]


def half_micro_batch(cfg: Any, _hardware: Hardware) -> tuple[str, Any] | None:
    t = cfg.train
    if t.micro_batch_size < 2:
        return None
    after = changed(cfg, {"train.micro_batch_size": t.micro_batch_size // 2, "train.grad_accum": t.grad_accum * 2})
    return f"train.micro_batch_size={t.micro_batch_size // 2} train.grad_accum={t.grad_accum * 2}", after


def fit_devices(cfg: Any, hardware: Hardware) -> tuple[str, Any] | None:
    have = hardware.devices
    if cfg.train.num_learners <= have:
        return None
    return f"train.num_learners={have}", changed(cfg, {"train.num_learners": have})


MEMORY = MemoryModel(_processes, lambda cfg: cfg.train.num_learners, (half_micro_batch, fit_devices),
                     "data.cutoff_len")
