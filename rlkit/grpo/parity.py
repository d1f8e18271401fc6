"""The parity probe after a weight sync: do the engines score tokens as the learner does?

Whatever the transport (`rlkit.transports`), the engines and the learner score the same token
sequences and the gap is held to a tolerance that depends on the precision, not on the way the
weights travelled: a transport that dropped or mangled a tensor shows as an engine far away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlkit.config import ModelConfig
from rlkit.errors import FaultError
from rlkit.rollout.config import RolloutConfig

if TYPE_CHECKING:
    from rlkit.learner.group import LearnerGroup
    from rlkit.rollout.engines import RolloutEngines
    from rlkit.transports import Transport


@dataclass(frozen=True)
class Probe:
    """What the parity probe scores: token sequences for the learner; for the engines the same ids,
    or for a prompt with images the prompt vLLM gets in rollouts (`prompts`: its text with one
    image mark per image and the pictures, which the engine expands into `sequences`' image
    tokens), and the pixel inputs of the learner's padded batch of `sequences` (`pixels`,
    `image.*` keys: `MicroBatch.padded`)."""

    sequences: list[list[int]]
    prompts: list[Any] | None = None
    pixels: dict[str, Any] = field(default_factory=dict)

    @property
    def engine_prompts(self) -> list[Any]:
        return self.prompts if self.prompts is not None else self.sequences


@dataclass(frozen=True)
class SyncTolerance:
    """What the parity probe holds the engines to: `nats` on the largest |engine - learner| token
    logprob (`statistic` "max": fp32, where the two agree to ~1e-5 on CPU) or on the mean over the
    probe's tokens ("mean": half precision, where single tokens differ by up to ~0.6 nats on a
    correct sync while the mean stays near 0.05)."""

    nats: float
    statistic: str


def sync_check_tol(rollout: RolloutConfig, model: ModelConfig, transport: Transport,
                   quantized_learner: bool = False) -> SyncTolerance:
    """`rollout.sync_check_tol` (or its default) and the statistic it bounds: the largest
    difference for fp32 models (default 1e-3 nats), the mean one for bf16/fp16 models (default
    0.2 nats: SmolLM2-135M in bf16 on CPU measured 0.58 nats on its worst token at the start,
    before any training, and means of 0.046-0.058 over its first syncs), the largest one and 2.0
    when the learner's base is 4-bit and the engines' is not (QLoRA whose `transport` moves the
    adapter alone, so the engines keep model.path's base: the gap is the quantization, 0.4 nats
    on the tiny model)."""
    if quantized_learner and transport.payload.adapter:
        return SyncTolerance(rollout.sync_check_tol or 2.0, "max")
    if model.dtype == "fp32":
        return SyncTolerance(rollout.sync_check_tol or 1e-3, "max")
    return SyncTolerance(rollout.sync_check_tol or 0.2, "mean")


def sync_check(engines: RolloutEngines, learners: LearnerGroup, probe: Probe, tol: SyncTolerance,
               when: str) -> tuple[float, float]:
    """Parity probe after a weight sync: the engines and the learner score `probe`; returns the
    largest and the mean |engine - learner| token logprob of the engine that is furthest on
    `tol.statistic`. Above `tol` (or NaN), or scoring a different number of tokens (an image
    expanded otherwise), a `FaultError` names that engine: its weights are not the learner's."""
    learner = learners.sequence_logprobs(probe.sequences, probe.pixels)
    want = torch.tensor([x for seq in learner for x in seq])
    gaps = []
    for name, got in zip(engines.names, engines.sequence_logprobs(probe.engine_prompts)):
        apart = next((i for i, (a, b) in enumerate(zip(got, learner)) if len(a) != len(b)), None)
        if apart is not None:
            raise FaultError(f"sync check {when}: {name} reads check prompt {apart + 1} as {len(got[apart]) + 1} "
                             f"tokens and the learner as {len(learner[apart]) + 1}: the engine and the model's "
                             "processor expand its images into different image tokens")
        gaps.append((torch.tensor([x for seq in got for x in seq]) - want).abs())
    stats = [(float(g.max()), float(g.mean())) for g in gaps]
    checked = [s[0] if tol.statistic == "max" else s[1] for s in stats]
    worst = max(range(len(checked)), key=lambda i: checked[i] if checked[i] == checked[i] else float("inf"))
    if not checked[worst] <= tol.nats:
        far = (f"up to {stats[worst][0]:.3g} nats away" if tol.statistic == "max" else
               f"{stats[worst][1]:.3g} nats away on average (up to {stats[worst][0]:.3g})")
        raise FaultError(f"sync check {when}: {engines.names[worst]} scores the check sequences {far} from the "
                         f"learner (rollout.sync_check_tol {tol.nats:g}, on the {tol.statistic} difference), so "
                         f"the weight sync did not reach it whole; stopping rather than training on its "
                         f"samples (checkpoints already written are intact)")
    return stats[worst]
