"""The GRPO recipe type: the shared sections (`rlkit/config.py`) plus the algorithm (`grpo:`),
the held-out evaluation and the reward functions. The accepted loss, KL and advantage names
come from `loss.py` and the advantage registry."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import ClassVar

from rlkit.config import (
    CheckpointConfig,
    CurriculumConfig,
    DataConfig,
    DeepSpeedConfig,
    Device,
    EvalConfig,
    Finetuning,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    QuantConfig,
    RayConfig,
    RolloutConfig,
    check_finetuning,
)
from rlkit.grpo.advantages import ADVANTAGES
from rlkit.grpo.loss import KLKind, LossType
from rlkit.recipe import check
from rlkit.reward.contract import RewardSpec


@dataclass(frozen=True)
class GRPOEvalConfig(EvalConfig):
    """Held-out prompts are generated and scored by the reward functions."""

    temperature: float | None = None  # None = rollout.temperature; 0 = greedy
    samples_per_prompt: int = 1

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "max_batches": "SFT only: GRPO evaluates every held-out prompt",
        "patience": "SFT only: GRPO does not stop early", "min_delta": "SFT only: GRPO does not stop early"}

    def __post_init__(self):
        super().__post_init__()
        check(self.temperature is None or self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(self.samples_per_prompt >= 1, "samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")


# Names a user may reach for that are not advantage estimators of their own.
_ADVANTAGE_HINTS = {"dr_grpo": "Dr. GRPO is `advantage: no_std` together with `loss_type: dr_grpo`",
                    "batch": "did you mean 'batch_std'?"}


@dataclass(frozen=True)
class GRPOAlgoConfig:
    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8  # G completions per prompt
    epochs: int = 1  # mu: optimisation passes over each rollout batch
    mini_batches: int = 1  # optimiser steps per pass
    micro_batch_size: int = 8  # completions per forward/backward on one learner
    num_learners: int = 1
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # clip-higher (DAPO: 0.28)
    beta: float = 0.0  # KL coefficient; 0 skips the reference model
    kl: KLKind = "k3"
    # How the per-token loss is averaged (grpo/loss.py); `dr_grpo` is Dr. GRPO's constant normaliser.
    loss_type: LossType = "dapo"
    # A registered estimator (grpo/advantages.py): grpo = (r - mean) / (std + eps) per group,
    # no_std = r - mean (Dr. GRPO's advantage), batch_std = (r - group mean) / (batch std + eps).
    advantage: str = "grpo"
    advantage_eps: float = 1e-4
    reward_default: float | None = None  # total reward of a sample every reward function skipped (None)
    async_generation: bool = False  # generate step k+1 while step k trains (one step off-policy)
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups and refill
    max_refill_rounds: int = 3
    mask_truncated: bool = False
    overlong_buffer: int = 0  # DAPO soft overlong punishment buffer (tokens); 0 = off
    overlong_penalty: float = 1.0

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "epochs", "mini_batches", "micro_batch_size", "num_learners"):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        check(self.group_size >= 2, "group_size", f"group-relative advantages need >= 2, got {self.group_size}")
        rollouts = self.prompts_per_step * self.group_size
        per_mb = rollouts // self.mini_batches
        check(rollouts % self.mini_batches == 0, "mini_batches",
              f"{rollouts} completions per step (prompts_per_step x group_size) do not split into "
              f"{self.mini_batches} mini-batches")
        check(per_mb % (self.micro_batch_size * self.num_learners) == 0, "micro_batch_size",
              f"a mini-batch of {per_mb} completions does not divide into micro_batch_size "
              f"{self.micro_batch_size} x num_learners {self.num_learners}")
        check(0 <= self.epsilon_low < 1, "epsilon_low", f"must be in [0, 1), got {self.epsilon_low}")
        check(self.epsilon_high >= 0, "epsilon_high", f"must be >= 0, got {self.epsilon_high}")
        check(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        if self.advantage not in ADVANTAGES:
            near = difflib.get_close_matches(self.advantage, list(ADVANTAGES), n=1)
            hint = _ADVANTAGE_HINTS.get(self.advantage) or (f"did you mean {near[0]!r}?" if near else "")
            check(False, "advantage", f"unknown estimator {self.advantage!r} (registered: "
                                      f"{', '.join(sorted(ADVANTAGES))}){'; ' + hint if hint else ''}")

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one learner."""
        rollouts = self.prompts_per_step * self.group_size
        return rollouts // (self.mini_batches * self.num_learners * self.micro_batch_size)


@dataclass(frozen=True)
class GRPOConfig:
    model: ModelConfig
    data: DataConfig
    output_dir: str
    rewards: tuple[RewardSpec, ...]
    seed: int = 42
    device: Device = "auto"
    finetuning: Finetuning = "full"
    lora: LoraConfig | None = None
    qlora: QuantConfig | None = None
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: GRPOEvalConfig = field(default_factory=GRPOEvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        check_finetuning(self)
        check(len(self.rewards) > 0, "rewards", "name at least one reward function")
        check(self.rollout.max_tokens < self.rollout.max_model_len, "rollout.max_tokens",
              f"must be < rollout.max_model_len ({self.rollout.max_model_len})")
        check(self.grpo.overlong_buffer < self.rollout.max_tokens, "grpo.overlong_buffer",
              f"must be < rollout.max_tokens ({self.rollout.max_tokens})")
        if self.rollout.colocate:
            check(self.rollout.num_engines == self.grpo.num_learners, "rollout.num_engines",
                  f"colocated engines are one per learner: set it to grpo.num_learners ({self.grpo.num_learners})")
            check(not self.grpo.async_generation, "grpo.async_generation",
                  "colocated engines share the learners' processes, so generation cannot overlap training;"
                  " set rollout.colocate: false to overlap")
