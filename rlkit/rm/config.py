"""The reward-model recipe type: the DPO stage's preference data, training and evaluation sections,
and `rm:` (TRL's `RewardConfig` loss key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlkit.config import StageConfig
from rlkit.dpo.config import DPOEvalConfig, PreferenceDataConfig
from rlkit.recipe import check
from rlkit.sft.config import SFTTrainConfig


@dataclass(frozen=True)
class RewardLossConfig:
    # TRL's center_rewards_coefficient: pulls the mean reward towards 0 (1e-2 in its docs; null: off)
    center_rewards_coefficient: float | None = None

    def __post_init__(self):
        check(self.center_rewards_coefficient is None or self.center_rewards_coefficient >= 0,
              "center_rewards_coefficient", f"must be >= 0, got {self.center_rewards_coefficient}")


@dataclass(frozen=True, kw_only=True)
class RMConfig(StageConfig):
    data: PreferenceDataConfig
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)  # micro_batch_size counts pairs
    eval: DPOEvalConfig = field(default_factory=DPOEvalConfig)
    rm: RewardLossConfig = field(default_factory=RewardLossConfig)

    PEER_NAMES: ClassVar[dict[str, str]] = {
        **StageConfig.PEER_NAMES, "num_train_epochs": "train.epochs",
        "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum",
        "max_length": "data.cutoff_len", "center_rewards_coefficient": "rm.center_rewards_coefficient"}
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        *StageConfig.RESUME_FIXED, "data.cutoff_len", "data.truncation_mode", "train.num_learners",
        "train.micro_batch_size", "train.grad_accum", "rm")

    def __post_init__(self):
        super().__post_init__()
        check(not (self.ray.resources.engine or self.ray.resources.teacher), "ray.resources",
              "a reward-model run has learners only: put their resources under ray.resources.learner")
