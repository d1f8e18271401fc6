"""The SFT recipe type: the shared sections (`rlkit/config.py`) plus SFT's data, training and
evaluation sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlkit.config import (
    DataConfig,
    EvalConfig,
    StageConfig,
)
from rlkit.recipe import check


@dataclass(frozen=True)
class SFTDataConfig(DataConfig):
    cutoff_len: int = 1024  # tokens per row (prompt + response); longer rows are cut, with a count before training
    packing: bool = False  # pack rows into one sequence (attention per row; not models with stateful layers)
    mask_history: bool = False  # multi-turn rows: train the last assistant turn only (default: every turn)

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        check(self.cutoff_len >= 8, "cutoff_len", f"must be >= 8, got {self.cutoff_len}")


@dataclass(frozen=True)
class SFTEvalConfig(EvalConfig):
    max_batches: int | None = None  # evaluate on this many micro-batches only (None: all held-out rows)
    patience: int | None = None  # early stopping after this many evals without improvement
    min_delta: float = 0.0  # an eval loss must improve by more than this to count (patience)

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "temperature": "GRPO only: SFT evaluates the loss, it does not generate",
        "samples_per_prompt": "GRPO only: SFT evaluates the loss, it does not generate"}


@dataclass(frozen=True)
class SFTTrainConfig:
    num_learners: int = 1  # data-parallel DeepSpeed learners (one device each)
    micro_batch_size: int = 4  # rows per forward/backward on one learner
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # default: epochs over the training rows
    epochs: float = 1.0  # passes over the training rows when max_steps is not set

    def __post_init__(self):
        check(self.num_learners >= 1, "num_learners", f"must be >= 1, got {self.num_learners}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        check(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class SFTConfig(StageConfig):
    data: SFTDataConfig
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)

    PEER_NAMES: ClassVar[dict[str, str]] = {
        **StageConfig.PEER_NAMES, "num_train_epochs": "train.epochs",
        "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum",
        "max_length": "data.cutoff_len", "max_seq_length": "data.cutoff_len"}
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        *StageConfig.RESUME_FIXED, "data.cutoff_len", "data.packing", "data.mask_history", "train.num_learners",
        "train.micro_batch_size", "train.grad_accum")

    def __post_init__(self):
        super().__post_init__()
        check(not (self.ray.resources.engine or self.ray.resources.teacher), "ray.resources",
              "an SFT run has learners only: put their resources under ray.resources.learner")
