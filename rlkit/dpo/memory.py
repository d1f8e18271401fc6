"""DPO's memory model (`rlkit estimate`, the check before launch): its learner ranks, each holding
a micro-batch's chosen and rejected rows and, under full fine-tuning, the reference's frozen copy.
`pair_memory` is the model of every stage on pairs (`rlkit rm`: no reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlkit.estimate.arch import Arch
from rlkit.estimate.memory import Hardware, MemoryModel, Process, context_bytes, learner_process, width_bytes
from rlkit.sft.memory import fit_devices, half_micro_batch


def pair_memory(reference: Callable[[Any], bool]) -> MemoryModel:
    """The learner ranks of a stage on pairs: 2 x micro_batch_size rows of cutoff_len tokens, and
    the reference's copy where `reference(cfg)` (full fine-tuning only: LoRA's reference is the policy)."""

    def processes(cfg: Any, arch: Arch, hardware: Hardware | None) -> list[Process]:
        t = cfg.train
        return [learner_process(cfg, arch, width_bytes(cfg.model.dtype, hardware), t.num_learners,
                                2 * t.micro_batch_size * cfg.data.cutoff_len, context_bytes(hardware),
                                reference=reference(cfg) and cfg.finetuning == "full")]

    return MemoryModel(processes, lambda cfg: cfg.train.num_learners, (half_micro_batch, fit_devices),
                       "data.cutoff_len")


# ORPO, SimPO, CPO: no reference; logprobs computed once: the starting policy itself computed them
MEMORY = pair_memory(reference=lambda cfg: not (cfg.dpo.reference_free or cfg.dpo.precompute_ref_log_probs))
