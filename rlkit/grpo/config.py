"""The GRPO recipe type: the shared sections (`rlkit/config.py`) plus the algorithm (`grpo:`),
the held-out evaluation and the reward functions. The accepted loss, KL and advantage names
come from `loss.py` and the advantage registry."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlkit.config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    StageConfig,
)
from rlkit.grpo.advantages import ADVANTAGES
from rlkit.grpo.correction import CorrectionMode
from rlkit.grpo.loss import LOSSES, ISLevel, KLKind, LossType, SoftGates
from rlkit.recipe import check
from rlkit.reward.contract import RewardSpec
from rlkit.rollout.config import RolloutConfig


@dataclass(frozen=True)
class GRPOEvalConfig(EvalConfig):
    """Held-out prompts are generated and scored by the reward functions."""

    temperature: float | None = None  # None = rollout.temperature; 0 = greedy
    samples_per_prompt: int = 1  # completions per held-out prompt

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "max_batches": "SFT only: GRPO evaluates every held-out prompt",
        "patience": "SFT only: GRPO does not stop early", "min_delta": "SFT only: GRPO does not stop early"}

    def __post_init__(self):
        super().__post_init__()
        check(self.temperature is None or self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(self.samples_per_prompt >= 1, "samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")


@dataclass(frozen=True)
class OnlineDifficultyConfig:
    """Prompts whose last group was all solved (every reward >= solved_at) or all failed (every
    reward <= failed_at) are kept by the sampler with probability `keep` (grpo/difficulty.py)."""

    keep: float = 0.25  # chance a prompt the group all solved / all failed is drawn again
    solved_at: float = 1.0  # a group whose rewards are all >= this is solved
    failed_at: float = 0.0  # a group whose rewards are all <= this failed

    def __post_init__(self):
        check(0 < self.keep <= 1, "keep", f"must be in (0, 1] (1 = off), got {self.keep}")
        check(self.failed_at < self.solved_at, "failed_at", f"must be < solved_at ({self.solved_at:g}), "
                                                            f"got {self.failed_at:g}")


# Names a user may reach for that are not advantage estimators of their own.
_ADVANTAGE_HINTS = {"batch": "did you mean 'batch_std'?", "reinforce++": "did you mean 'reinforce_pp'?",
                    "gdpo": "GDPO is `multi_objective_aggregation: normalize_then_sum`"}


@dataclass(frozen=True)
class GRPOAlgoConfig:
    steps: int = 100  # training steps (one rollout batch each)
    prompts_per_step: int = 8  # prompts sampled per step (each gets group_size completions)
    group_size: int = 8  # G completions per prompt
    epochs: int = 1  # mu: optimisation passes over each rollout batch
    mini_batches: int = 1  # optimiser steps per pass
    micro_batch_size: int = 8  # completions per forward/backward on one learner
    # Padding-free micro-batches (verl's dynamic batch size): a learner's completions are packed into
    # micro-batches of at most this many tokens (prompt + completion), each one row without padding;
    # 0 = micro_batch_size completions per micro-batch, padded to the longest. At least max_model_len.
    max_tokens_per_micro_batch: int = 0
    num_learners: int = 1  # data-parallel DeepSpeed learners (one device each)
    epsilon_low: float = 0.2  # PPO clip below: ratio >= 1 - epsilon_low
    epsilon_high: float = 0.2  # clip-higher (DAPO: 0.28)
    beta: float = 0.0  # KL coefficient; 0 skips the reference model
    kl: KLKind = "k3"  # KL estimator (k1, k2, k3) when beta > 0
    # TRL's use_bias_correction_kl (its default since 1.16): the KL term times the ratio pi / pi_old, which
    # makes k3's gradient the unbiased reverse-KL one. Off here, as verl and OpenRLHF: see docs/grpo.md.
    use_bias_correction_kl: bool = False
    # The per-token loss and how it is averaged (grpo/loss.py): grpo, bnpo, dr_grpo (Dr. GRPO's
    # constant normaliser), dapo, cispo (epsilon_high is then the weight cap, e.g. 5), sapo, luspo, vespo.
    loss_type: LossType = "dapo"
    importance_sampling_level: ISLevel = "token"  # sequence = GSPO's length-normalised sequence ratio
    # The soft losses' parameters, named and defaulted as `loss.SoftGates` (TRL 1.16's).
    sapo_temperature_pos: float = SoftGates.sapo_temperature_pos
    sapo_temperature_neg: float = SoftGates.sapo_temperature_neg  # SAPO gate temperature, negative advantages
    vespo_k_pos: float = SoftGates.vespo_k_pos  # VESPO gate, positive advantages
    vespo_lambda_pos: float = SoftGates.vespo_lambda_pos  # VESPO gate, positive advantages
    vespo_k_neg: float = SoftGates.vespo_k_neg  # VESPO gate, negative advantages
    vespo_lambda_neg: float = SoftGates.vespo_lambda_neg  # VESPO gate, negative advantages
    # A registered estimator (grpo/advantages.py): grpo = (r - mean) / (std + eps) per group,
    # no_std or dr_grpo = r - mean, batch_std = (r - group mean) / (batch std + eps), rloo = leave-one-out
    # baseline, reinforce_pp = batch-whitened reward, reinforce_pp_baseline = group-centred then whitened.
    advantage: str = "grpo"
    advantage_eps: float = 1e-4  # added to the std in the advantage's denominator
    # Several reward functions: sum_then_normalize = the weighted sum goes to `advantage`;
    # normalize_then_sum = GDPO (each normalised per group, summed, whitened over the batch).
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    reward_default: float | None = None  # total reward of a sample every reward function skipped (None)
    # Rollouts may come from a policy up to K updates older than the one they train: 0 = on-policy
    # (generate, then train), 1 = generate step k+1 while step k trains, K = K steps ahead.
    max_staleness: int = 0
    # Streaming (needs max_staleness >= 1 and separate engines): engines generate without pause from a
    # queue of prompts, a step trains on the first prompts_per_step groups done, and new weights load
    # mid-generation (partial rollouts): each token keeps the version that sampled it; a group whose
    # oldest token is more than max_staleness versions old is not trained (dropped, counted).
    streaming: bool = False
    # Streaming: the groups generating (and drawn to) at most (null: 2 x prompts_per_step), as AReaL's
    # max_concurrent_rollouts: more keep the engines fuller but slow each sample, so more go stale.
    max_running_groups: int | None = None
    # After a load mid-generation the running samples' KV cache is kept as the old weights made it
    # (keep: measured faster, docs/speed.md), or computed again with the new weights (recompute).
    partial_kv: Literal["keep", "recompute"] = "keep"
    # The weight loads a streamed sample may span (null: bounded by max_staleness alone); past it its
    # group is dropped, or finished under the new policy, as over_interrupted says (both counted).
    max_interruptions: int | None = None
    # Past max_interruptions: drop the group (counted, its prompt not trained), or let it finish.
    over_interrupted: Literal["drop", "finish"] = "drop"
    # Importance weights pi_learner / pi_engine on the policy loss (grpo/correction.py): the
    # engine/learner numeric gap and staleness. Default token_truncate at 2 (TIS): see docs/grpo.md.
    rollout_correction: CorrectionMode = "token_truncate"
    correction_clip_min: float | None = None  # lower bound of the importance weight (None: none)
    correction_clip_max: float | None = 2.0  # upper bound of the importance weight (None: none)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2 sequence masking (e.g. 0.5); None = off
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups and refill
    max_refill_rounds: int = 3  # dynamic sampling: generation rounds to replace all-equal groups
    mask_truncated: bool = False  # no loss on completions cut at max_tokens (DAPO)
    overlong_buffer: int = 0  # DAPO soft overlong punishment buffer (tokens); 0 = off
    overlong_penalty: float = 1.0  # largest penalty of the overlong buffer

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "async_generation": "replaced by max_staleness: 1 generates step k+1 while step k trains"}

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
        check(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        check(not self.streaming or self.max_staleness >= 1, "streaming",
              "streamed groups train up to max_staleness versions after they started: set max_staleness >= 1")
        check(self.max_running_groups is None or self.max_running_groups >= 1, "max_running_groups",
              f"must be >= 1 (or null), got {self.max_running_groups}")
        check(self.max_interruptions is None or self.max_interruptions >= 0, "max_interruptions",
              f"must be >= 0 (or null), got {self.max_interruptions}")
        check(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch",
              f"must be >= 0 (0 = off), got {self.max_tokens_per_micro_batch}")
        self._check_correction()
        if self.advantage not in ADVANTAGES:
            near = difflib.get_close_matches(self.advantage, list(ADVANTAGES), n=1)
            hint = _ADVANTAGE_HINTS.get(self.advantage) or (f"did you mean {near[0]!r}?" if near else "")
            check(False, "advantage", f"unknown estimator {self.advantage!r} (registered: "
                                      f"{', '.join(sorted(ADVANTAGES))}){'; ' + hint if hint else ''}")

    def _check_correction(self) -> None:
        lo, hi = self.correction_clip_min, self.correction_clip_max
        if self.rollout_correction != "none":
            check(lo is not None or hi is not None, "correction_clip_max",
                  f"rollout_correction {self.rollout_correction} needs a bound: set correction_clip_max (e.g. 2.0)")
        check(lo is None or lo >= 0, "correction_clip_min", f"must be >= 0, got {lo}")
        check(lo is None or hi is None or lo < hi, "correction_clip_min",
              f"must be < correction_clip_max ({hi}), got {lo}")
        check(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold > 0,
              "off_policy_mask_threshold", f"must be > 0 (or null), got {self.off_policy_mask_threshold}")
        loss = LOSSES[self.loss_type]
        check(not loss.weighs_sequences or not self.rollout_correction.startswith("sequence"), "rollout_correction",
              f"{self.loss_type} weighs whole sequences itself: use token_truncate, token_mask or none")
        check(not loss.caps_ratio or self.epsilon_high > 1, "epsilon_high",
              f"{self.loss_type} caps the importance weight at epsilon_high: use a value > 1 (MiniMax: 5), "
              f"got {self.epsilon_high}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")

    @property
    def async_generation(self) -> bool:
        """Whether generation overlaps training (max_staleness >= 1)."""
        return self.max_staleness > 0

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one learner."""
        rollouts = self.prompts_per_step * self.group_size
        return rollouts // (self.mini_batches * self.num_learners * self.micro_batch_size)


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (`rlkit distill`): the student samples as in GRPO, a frozen teacher
    scores the same tokens. `loss: reverse_kl`: each sampled token's log p_teacher - log p_student
    is its advantage in the policy loss (Thinking Machines, prime-rl opd); `loss: jsd`: TRL's
    DistillationTrainer loss, the generalized JSD between the two next-token distributions over the
    whole vocabulary at every completion position (`beta` 0: forward KL, 1: reverse KL)."""

    teacher: ModelConfig  # the frozen teacher (same tokenizer as the student), held beside each learner rank
    loss: Literal["reverse_kl", "jsd"] = "reverse_kl"  # the sampled per-token advantage, or the full-vocabulary JSD
    beta: float = 1.0  # jsd only: TRL's interpolation (0 forward KL(teacher||student), 0.5 JSD, 1 reverse KL)
    coef: float = 1.0  # weight of the teacher's signal (the per-token advantage, or the JSD term of the loss)
    reward_weight: float = 0.0  # weight of the task rewards (their group advantage / policy loss; 0: logged only)
    # learner: a copy beside each learner rank; actor: one Ray actor of its own (a device, or CPUs), which
    # scores each step's samples before the learners train (reverse_kl only: it sends one logprob per token)
    placement: Literal["learner", "actor"] = "learner"
    node: str | None = None  # placement actor: the Ray node (its IP address) to run the teacher on (None: any)

    def __post_init__(self):
        check(self.coef >= 0, "coef", f"must be >= 0, got {self.coef}")
        check(self.reward_weight >= 0, "reward_weight", f"must be >= 0, got {self.reward_weight}")
        check(self.coef > 0 or self.reward_weight > 0, "coef", "coef and reward_weight are both 0: nothing to learn")
        check(0.0 <= self.beta <= 1.0, "beta", f"must be in [0, 1] (0: forward KL, 1: reverse KL), got {self.beta}")
        check(self.loss == "jsd" or self.beta == 1.0, "beta", "applies to loss: jsd only (reverse_kl samples the "
              "reverse KL); set loss: jsd or drop beta")
        check(self.placement == "learner" or self.loss == "reverse_kl", "placement",
              "actor needs loss: reverse_kl (the full-vocabulary jsd projects the teacher's hidden states beside the "
              "student's, in the learner); use placement: learner for jsd")
        check(self.node is None or self.placement == "actor", "node", "places the teacher's own actor: set "
              "placement: actor (placement: learner puts a copy beside each learner rank)")


@dataclass(frozen=True, kw_only=True)
class GRPOConfig(StageConfig):
    data: DataConfig
    rewards: tuple[RewardSpec, ...]
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    online_difficulty: OnlineDifficultyConfig | None = None  # None = off
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    eval: GRPOEvalConfig = field(default_factory=GRPOEvalConfig)
    distill: DistillConfig | None = None  # on-policy distillation from a teacher (rlkit distill)

    PEER_NAMES: ClassVar[dict[str, str]] = {
        **StageConfig.PEER_NAMES,
        "max_steps": "grpo.steps", "num_generations": "grpo.group_size", "n_samples_per_prompt": "grpo.group_size",
        "max_completion_length": "rollout.max_tokens", "generate_max_len": "rollout.max_tokens",
        "per_device_train_batch_size": "grpo.micro_batch_size", "num_iterations": "grpo.epochs",
        "init_kl_coef": "grpo.beta", "vllm_num_engines": "rollout.num_engines",
        "vllm_tensor_parallel_size": "rollout.tensor_parallel_size",
        "max_tool_calling_iterations": "rollout.max_tool_calls", "environment_factory": "rollout.environment",
        "teacher_model_name_or_path": "distill.teacher.path"}
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        *StageConfig.RESUME_FIXED, "grpo.prompts_per_step", "grpo.group_size", "grpo.num_learners",
        "grpo.micro_batch_size", "grpo.mini_batches", "grpo.max_staleness", "grpo.streaming")

    def models(self) -> dict[str, ModelConfig]:
        return {**super().models(), **({"distill.teacher": self.distill.teacher} if self.distill else {})}

    def __post_init__(self):
        super().__post_init__()
        check(not (self.ray.resources.engine and self.rollout.colocate), "ray.resources.engine",
              "colocated engines live in the learners' actors: put their resources under ray.resources.learner")
        check(not self.ray.resources.teacher or (self.distill is not None and self.distill.placement == "actor"),
              "ray.resources.teacher", "the teacher has an actor of its own only with distill.placement: actor")
        check(len(self.rewards) > 0 or bool(self.rollout.environment or self.rollout.interaction
                                            or self.rollout.program.on), "rewards",
              "name at least one reward function (or an environment with get_reward: rollout.environment, or an "
              "agent program that returns its reward: rollout.program)")
        check(self.rollout.max_tokens < self.rollout.max_model_len, "rollout.max_tokens",
              f"must be < rollout.max_model_len ({self.rollout.max_model_len})")
        check(self.grpo.overlong_buffer < self.rollout.max_tokens, "grpo.overlong_buffer",
              f"must be < rollout.max_tokens ({self.rollout.max_tokens})")
        budget = self.grpo.max_tokens_per_micro_batch
        check(budget == 0 or budget >= self.rollout.max_model_len, "grpo.max_tokens_per_micro_batch",
              f"must hold the longest sequence, rollout.max_model_len ({self.rollout.max_model_len}), got {budget}")
        if self.rollout.lora_sync == "adapter":
            check(self.finetuning != "full", "rollout.lora_sync",
                  "adapter sync sends a LoRA adapter: it needs finetuning: lora or qlora (use merged)")
            check(self.lora is None or self.lora.r <= 512, "lora.r", f"vLLM serves LoRA ranks up to 512, "
                                                                   f"got {self.lora and self.lora.r}")
            unserved = sorted({"lm_head", "embed_tokens"} & set(self.lora.target_modules if self.lora else ()))
            check(not unserved, "lora.target_modules", f"vLLM serves adapters on the decoder's linear layers, not "
                  f"{', '.join(unserved)}: drop them, or use rollout.lora_sync: merged")
        if self.rollout.colocate:
            check(self.rollout.num_engines == self.grpo.num_learners, "rollout.num_engines",
                  f"colocated engines are one per learner: set it to grpo.num_learners ({self.grpo.num_learners})")
            check(not self.grpo.async_generation, "grpo.max_staleness",
                  "colocated engines share the learners' processes, so generation cannot overlap training;"
                  " use max_staleness: 0, or set rollout.colocate: false to overlap")
        r = self.rollout
        multi_turn = r.environment or r.interaction or r.program.on or r.tools or r.calculator
        check(not self.grpo.streaming or not multi_turn, "grpo.streaming",
              "streamed rollouts are single-turn so far: set it to false for tools, the calculator, environments "
              "and agent programs (max_staleness still overlaps their steps)")
