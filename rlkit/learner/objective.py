"""What a stage hands the learner (an `Objective`) and what it gets back (`StepMetrics`).

The learner knows nothing of SFT or GRPO: a stage builds its objective once from its recipe
section, a small frozen (hence picklable) object, and the learner calls it on each micro-batch
inside its DeepSpeed step. A new loss is a new objective, in the stage's own package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

# Per-token logprobs a learner can attach to micro-batches before its first update (`Learner.fit`):
# key -> the model that scores the batch. Shifted space, [B, L-1], at the objective's temperature.
LOGPROB_SOURCES = {"ref_logp": "reference", "old_logp": "policy", "teacher_logp": "teacher"}


class MicroBatch(Mapping[str, Any]):
    """The tensors of one forward/backward, by name: the one batch type that crosses the Ray
    boundary into a learner (CPU on arrival). A stage builds it from its own typed batch (GRPO:
    `GRPOBatch.micro_batch`, SFT: its collator), and its objective reads it by the stage's keys.
    Read-only: the learner never changes one; the logprobs it scores before the first update
    (`LOGPROB_SOURCES`) give a new batch (`attach`), checked against the rows it holds."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, Any]):
        if "input_ids" not in tensors:
            raise ValueError(f"a micro-batch needs input_ids (has {', '.join(tensors) or 'nothing'})")
        self._tensors = dict(tensors)

    @classmethod
    def of(cls, batch: Mapping[str, Any]) -> MicroBatch:
        return batch if isinstance(batch, MicroBatch) else cls(batch)

    @classmethod
    def padded(cls, sequences: Sequence[Sequence[int]], extra: Mapping[str, Any] | None = None) -> MicroBatch:
        """Token sequences right-padded (with 0) into input_ids and their attention_mask, and the
        `extra` tensors of those rows (a parity probe's pixel inputs)."""
        width = max(len(s) for s in sequences)
        ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        return cls({"input_ids": ids, "attention_mask": mask, **(extra or {})})

    def __getitem__(self, key: str) -> Any:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) if isinstance(v, Tensor) else v for k, v in self._tensors.items()}
        return f"MicroBatch({shapes})"

    def __reduce__(self) -> tuple[Any, ...]:
        return MicroBatch, (self._tensors,)

    def attach(self, key: str, logp: Tensor) -> MicroBatch:
        """This batch with the logprobs `key` (a `LOGPROB_SOURCES` name) scored on its rows: one per
        (shifted) position of the loss layout, [B, L-1]."""
        if key not in LOGPROB_SOURCES or key in self._tensors:
            raise ValueError(f"cannot attach {key!r}: not a logprob source, or already there")
        rows = self._tensors.get("completion_mask", self._tensors.get("labels", self._tensors["input_ids"]))
        if tuple(logp.shape) != (rows.shape[0], rows.shape[1] - 1):
            raise ValueError(f"{key} {tuple(logp.shape)} does not fit a batch of {tuple(rows.shape)}")
        return MicroBatch({**self._tensors, key: logp})

    def to(self, device: Any) -> MicroBatch:
        return MicroBatch({k: v.to(device) if isinstance(v, Tensor) else v for k, v in self._tensors.items()})


Steps = list[list[MicroBatch]]  # optimizer steps of one rank, each `grad_accum` micro-batches


class Objective(Protocol):
    """A training objective: frozen, picklable, built once per run by its stage.

    `temperature`: logits are divided by it wherever logprobs are computed for this objective.
    `needs`: keys of `LOGPROB_SOURCES` the learner attaches to every micro-batch before the first
    update of a `fit` (e.g. the reference policy's logprobs for a KL term).
    `__call__(model, batch) -> (loss, metrics)`: the loss to backpropagate for one micro-batch and
    metrics as 0-dim tensors or floats; the learner sums metrics over micro-batches, except names
    ending in `_max` / `_min`, which it reduces with max / min (see `accumulate`).
    `positions(batch)`: bool [B, L-1], the (shifted) positions whose logprobs the objective reads;
    the logprobs of `needs` are computed there only.
    `uses` (optional): names of frozen models the objective reads inside its call ("teacher": a
    full-vocabulary distillation loss); the learner passes them as keyword arguments.
    """

    temperature: float
    needs: tuple[str, ...]

    def __call__(self, model: Any, batch: MicroBatch, **frozen: Any) -> tuple[Tensor, dict[str, Any]]: ...

    def positions(self, batch: MicroBatch) -> Tensor: ...


def step_normaliser(tokens: int, world_size: int, grad_accum: int) -> float:
    """`num_items_in_batch` that makes a loss summed over a micro-batch's tokens a token mean over the
    whole optimizer step (TRL's reduction: SFT's NLL, GRPO's `dapo` loss), when the learner divides
    each micro-batch's loss by `grad_accum` and DeepSpeed averages the gradients of `world_size`
    ranks: ``max(tokens, 1) / (world_size * grad_accum)``, `tokens` = the step's loss tokens summed
    over all ranks."""
    return max(tokens, 1) / (world_size * grad_accum)


def reduction(key: str) -> str:
    """How a metric combines over micro-batches, steps and ranks: "max", "min" or "mean"."""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"


def accumulate(sums: dict[str, float], key: str, value: float) -> None:
    """Add one micro-batch's metric into `sums` (a running max / min for `_max` / `_min` names)."""
    kind = reduction(key)
    if key not in sums or kind == "mean":
        sums[key] = sums.get(key, 0.0) + value
    else:
        sums[key] = max(sums[key], value) if kind == "max" else min(sums[key], value)


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step on one rank: metric sums over its micro-batches, their count, the global
    grad norm (before clipping) and the learning rate the step used; its wall seconds, the input
    tokens it trained on, their model FLOPs and the device's peak FLOP/s (`learner/perf.py`)."""

    sums: dict[str, float]
    micro_batches: int
    grad_norm: float
    lr: float
    seconds: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0
    peak_flops: float = float("nan")

    def mean(self, key: str) -> float:
        """Mean of a metric over this step's micro-batches (its max / min for `_max` / `_min` names)."""
        if reduction(key) != "mean":
            return self.sums[key]
        return self.sums[key] / max(self.micro_batches, 1)


@dataclass(frozen=True)
class FitResult:
    """What `Learner.fit` returns: its optimizer steps in order, and the seconds spent computing the
    logprobs the objective needs before the first update."""

    steps: list[StepMetrics] = field(default_factory=list)
    logprob_seconds: float = 0.0


def mean_metrics(steps: Sequence[StepMetrics]) -> dict[str, float]:
    """Per-micro-batch means averaged over steps (and ranks), `_max` / `_min` metrics reduced with
    max / min, plus `grad_norm` and `lr` averaged."""
    if not steps:
        return {}
    keys = sorted({k for s in steps for k in s.sums})
    out = {}
    for k in keys:
        values = [s.mean(k) for s in steps if k in s.sums]
        kind = reduction(k)
        out[k] = max(values) if kind == "max" else min(values) if kind == "min" else sum(values) / len(values)
    out["grad_norm"] = sum(s.grad_norm for s in steps) / len(steps)
    out["lr"] = sum(s.lr for s in steps) / len(steps)
    return out
