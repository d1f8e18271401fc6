"""Typed recipes: one frozen dataclass per stage (`SFTConfig`, `GRPOConfig`) built from shared parts.

`load(stage, path, overrides)` reads the YAML, applies `key.sub=value` overrides and checks
types and cross-field rules before any work starts; see `rlkit.recipe` for the error format.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rlkit.data.curriculum import DEFAULT_LEVELS, DEFAULT_PHASES, validate_phases
from rlkit.data.formats import ROW_FORMATS
from rlkit.data.templates import TEMPLATES
from rlkit.errors import ConfigError
from rlkit.grpo.advantages import ADVANTAGES
from rlkit.grpo.loss import KL_KINDS, LOSS_TYPES
from rlkit.recipe import build, check, merge, parse_overrides, read_yaml
from rlkit.reward.contract import RewardSpec

# The accepted values come from the code that reads them (the loader, the templates, the loss).
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
DataFormat = Literal[ROW_FORMATS]
Template = Literal[TEMPLATES]
LossType = Literal[LOSS_TYPES]
KLKind = Literal[KL_KINDS]
Device = Literal["auto", "cuda", "rocm", "npu", "cpu"]


@dataclass(frozen=True)
class ModelConfig:
    path: str  # local HF model directory (or hub id where a hub is reachable)
    tokenizer: str | None = None  # defaults to `path`
    dtype: Dtype = "auto"  # auto: bf16 where the device supports it, else fp32
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    tiny: Literal["tiny", "tiny-untied", "25m"] | None = None  # build offline at `path` if missing


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self):
        check(self.r > 0, "r", f"LoRA rank must be > 0, got {self.r}")
        check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(len(self.target_modules) > 0, "target_modules", "name at least one module")


@dataclass(frozen=True)
class QuantConfig:
    """QLoRA 4-bit base weights (bitsandbytes)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


@dataclass(frozen=True)
class DataConfig:
    """Data both stages read. SFT rows or GRPO prompts; the source kind (JSON, JSONL,
    dataset_info.json, a save_to_disk folder) comes from the path, `format` is the row schema."""

    train: str
    eval: str | None = None
    format: DataFormat = "auto"
    dataset: str | None = None  # entry name in a dataset_info.json
    template: Template = "alpaca"
    skip_bad_rows: bool = False
    synthetic_seed: int | None = None  # write the offline arithmetic task next to `train` if missing

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "cutoff_len": "SFT only: GRPO prompts are not cut, completions end at rollout.max_tokens",
        "packing": "SFT only: GRPO learner batches are not packed"}


@dataclass(frozen=True)
class SFTDataConfig(DataConfig):
    cutoff_len: int = 1024
    packing: bool = False

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        check(self.cutoff_len >= 8, "cutoff_len", f"must be >= 8, got {self.cutoff_len}")


@dataclass(frozen=True)
class PhaseConfig:
    until: float  # end of this phase as a fraction of training (last one is 1.0)
    mix: tuple[float, ...]  # share of each level, in `levels` order; sums to 1


@dataclass(frozen=True)
class CurriculumConfig:
    enabled: bool = True  # turns itself off (one warning) when rows have no `difficulty`
    levels: tuple[str, ...] = DEFAULT_LEVELS
    phases: tuple[PhaseConfig, ...] = tuple(PhaseConfig(until, mix) for until, mix in DEFAULT_PHASES)

    def __post_init__(self):
        validate_phases(self.levels, self.schedule)  # the sampler's own check; errors name the key

    @property
    def schedule(self) -> list[tuple[float, tuple[float, ...]]]:
        """`(until, mix)` per phase, as the sampler takes them."""
        return [(p.until, p.mix) for p in self.phases]


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0  # 0 turns clipping off

    def __post_init__(self):
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        check(self.warmup_steps == 0 or self.warmup_ratio == 0.0, "warmup_ratio",
              "set warmup_steps or warmup_ratio, not both")


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    torch_adam: bool = True  # torch AdamW instead of DeepSpeed's JIT-compiled fused/CPU Adam
    dist_timeout_s: int = 600  # init_distributed timeout: a hang fails instead of waiting forever
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the generated DeepSpeed config

    def __post_init__(self):
        check(not self.offload_param or self.zero_stage == 3, "offload_param", "needs zero_stage: 3")
        check(not self.offload_optimizer or self.zero_stage >= 1, "offload_optimizer", "needs zero_stage >= 1")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (needs `data.eval`): before the first step, every `every` steps and
    after the last step; `every: 0` = only before the first and after the last, in both stages."""

    every: int = 0

    def __post_init__(self):
        check(self.every >= 0, "every", f"must be >= 0, got {self.every}")


@dataclass(frozen=True)
class SFTEvalConfig(EvalConfig):
    max_batches: int | None = None
    patience: int | None = None  # early stopping after this many evals without improvement
    min_delta: float = 0.0

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "temperature": "GRPO only: SFT evaluates the loss, it does not generate",
        "samples_per_prompt": "GRPO only: SFT evaluates the loss, it does not generate"}


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


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only the final one
    keep_last: int = 2
    resume: str = "auto"  # auto | never | a checkpoint directory

    def __post_init__(self):
        check(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 1
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "rlkit"
    progress: Literal["auto", "bar", "plain", "none"] = "auto"


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # "auto" or ray://... to join a cluster; None starts a local one
    num_cpus: int | None = None  # for the local instance
    cpus_per_actor: float = 1.0


@dataclass(frozen=True)
class SFTTrainConfig:
    num_learners: int = 1
    micro_batch_size: int = 4
    grad_accum: int = 1
    max_steps: int | None = None  # default: epochs over the training rows
    epochs: float = 1.0

    def __post_init__(self):
        check(self.num_learners >= 1, "num_learners", f"must be >= 1, got {self.num_learners}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        check(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1")


Finetuning = Literal["full", "lora", "qlora"]


def _check_finetuning(cfg: Any) -> None:
    check(cfg.finetuning == "full" or cfg.lora is not None, "lora",
          f"finetuning: {cfg.finetuning} needs a lora section (r, alpha, target_modules)")
    check(cfg.qlora is None or cfg.finetuning == "qlora", "qlora",
          "a qlora section needs finetuning: qlora (QLoRA trains LoRA adapters on 4-bit weights)")
    check(cfg.finetuning != "qlora" or cfg.deepspeed.zero_stage != 3, "deepspeed.zero_stage",
          "QLoRA 4-bit weights cannot be partitioned by ZeRO-3; use zero_stage 0-2")


@dataclass(frozen=True)
class SFTConfig:
    model: ModelConfig
    data: SFTDataConfig
    output_dir: str
    seed: int = 42
    device: Device = "auto"
    finetuning: Finetuning = "full"
    lora: LoraConfig | None = None
    qlora: QuantConfig | None = None
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        _check_finetuning(self)


@dataclass(frozen=True)
class RolloutConfig:
    num_engines: int = 1
    tensor_parallel_size: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0  # CPU engines: KV cache cap in GiB (vLLM takes 16 GiB otherwise)
    sync_bucket_mib: int = 256  # weight sync through the Ray object store, one bucket (MiB) at a time
    # Placement: False = engines in their own actors and devices; True = one engine inside each
    # learner process (hybrid engine), sharing its device, weights handed over in-process.
    colocate: bool = False
    # auto = in_process when colocated, else object_store; broadcast = NCCL/HCCL group from
    # learner rank 0 to every engine worker (accelerators; opt-in, not yet checked on a GPU here).
    sync: Literal["auto", "object_store", "broadcast", "in_process"] = "auto"
    sleep: bool = True  # colocated on an accelerator: vLLM sleep mode frees engine memory while training

    def __post_init__(self):
        check(self.sync != "in_process" or self.colocate, "sync",
              "in_process sync needs colocate: true (the engine must live in the learner process)")
        check(self.sync != "broadcast" or not self.colocate, "sync",
              "colocated engines take weights in-process; use sync: auto or in_process")
        check(not self.colocate or self.tensor_parallel_size == 1, "tensor_parallel_size",
              "colocated engines are one replica per learner rank (tensor_parallel_size 1); "
              "set colocate: false for tensor-parallel engines")
        check(self.num_engines >= 1, "num_engines", f"must be >= 1, got {self.num_engines}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")


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
        return self.prompts_per_step * self.group_size // (self.mini_batches * self.num_learners * self.micro_batch_size)


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
        _check_finetuning(self)
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


STAGES: dict[str, type] = {"sft": SFTConfig, "grpo": GRPOConfig}


def load(stage: str, path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a recipe for `stage`, apply overrides, return the frozen config. Raises ConfigError."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; expected one of {sorted(STAGES)}")
    data = read_yaml(path)
    declared = data.pop("stage", stage)
    if declared != stage:
        raise ConfigError(f"{path}: stage: this recipe is for {declared!r}, not {stage!r}")
    if overrides:
        data = merge(data, parse_overrides(overrides))
    return build(STAGES[stage], data, str(path))


__all__ = ["ConfigError", "load", "SFTConfig", "GRPOConfig", "STAGES"]
