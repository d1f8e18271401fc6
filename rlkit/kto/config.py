"""The KTO recipe type: the DPO stage's data (unpaired rows, or pairs read as two rows each),
training and evaluation sections, and `kto:` (TRL's `KTOConfig` loss keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlkit.config import StageConfig
from rlkit.dpo.config import DPOEvalConfig, PreferenceDataConfig
from rlkit.recipe import check
from rlkit.sft.config import SFTTrainConfig


@dataclass(frozen=True)
class KTOLossConfig:
    """TRL 1.16's `KTOConfig` loss keys and their defaults."""

    # kto: the KTO paper's loss, with the KL estimate from mismatched completions; apo_zero_unpaired: APO-zero's
    # unpaired form (no KL estimate)
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    beta: float = 0.1  # strength of the KL constraint against the reference
    desirable_weight: float = 1.0  # weight of the desirable rows' losses
    undesirable_weight: float = 1.0  # weight of the undesirable rows' losses

    def __post_init__(self):
        check(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        check(self.desirable_weight > 0 and self.undesirable_weight > 0, "desirable_weight",
              f"both weights must be > 0, got {self.desirable_weight} and {self.undesirable_weight}")


@dataclass(frozen=True, kw_only=True)
class KTOConfig(StageConfig):
    data: PreferenceDataConfig
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)  # micro_batch_size counts rows
    eval: DPOEvalConfig = field(default_factory=DPOEvalConfig)
    kto: KTOLossConfig = field(default_factory=KTOLossConfig)

    PEER_NAMES: ClassVar[dict[str, str]] = {
        **StageConfig.PEER_NAMES, "num_train_epochs": "train.epochs", "pref_beta": "kto.beta",
        "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum",
        "max_length": "data.cutoff_len", "desirable_weight": "kto.desirable_weight",
        "undesirable_weight": "kto.undesirable_weight", "kto_chosen_weight": "kto.desirable_weight",
        "kto_rejected_weight": "kto.undesirable_weight"}
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        *StageConfig.RESUME_FIXED, "data.cutoff_len", "data.truncation_mode", "train.num_learners",
        "train.micro_batch_size", "train.grad_accum", "kto")

    def __post_init__(self):
        super().__post_init__()
        check(self.kto.loss_type != "kto" or self.train.micro_batch_size >= 2, "train.micro_batch_size",
              "KTO's KL estimate pairs each prompt with another row's completion of its micro-batch: use 2 or more")
        check(not (self.ray.resources.engine or self.ray.resources.teacher), "ray.resources",
              "a KTO run has learners only: put their resources under ray.resources.learner")
