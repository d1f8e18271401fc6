"""Typed recipes: one frozen dataclass per stage (`SFTConfig`, `GRPOConfig`) built from shared parts.

`load(stage, path, overrides)` reads the YAML, applies `key.sub=value` overrides and checks
types and cross-field rules before any work starts; see `rlkit.recipe` for the error format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlkit.recipe import ConfigError, Invalid, build, check, merge, parse_overrides, read_yaml

Dtype = Literal["auto", "fp32", "bf16", "fp16"]
LEVELS = ("explain", "reasoning", "topology")


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
    train: str
    eval: str | None = None
    format: Literal["auto", "alpaca", "messages", "prompt", "dataset_info", "hf"] = "auto"
    dataset: str | None = None  # entry name in a dataset_info.json
    template: Literal["alpaca", "chat"] = "alpaca"
    cutoff_len: int = 1024
    packing: bool = False
    skip_bad_rows: bool = False
    synthetic_seed: int | None = None  # write the offline arithmetic task next to `train` if missing

    def __post_init__(self):
        check(self.cutoff_len >= 8, "cutoff_len", f"must be >= 8, got {self.cutoff_len}")
        check(self.format != "dataset_info" or self.dataset is not None, "dataset",
              "format 'dataset_info' needs the dataset name to read from dataset_info.json")


@dataclass(frozen=True)
class PhaseConfig:
    until: float  # end of this phase as a fraction of training (last one is 1.0)
    mix: tuple[float, ...]  # share of each level, in `levels` order; sums to 1


@dataclass(frozen=True)
class CurriculumConfig:
    enabled: bool = True  # turns itself off (one warning) when rows have no `difficulty`
    levels: tuple[str, ...] = LEVELS
    phases: tuple[PhaseConfig, ...] = (
        PhaseConfig(0.3, (0.8, 0.2, 0.0)),
        PhaseConfig(0.7, (0.4, 0.4, 0.2)),
        PhaseConfig(1.0, (0.25, 0.35, 0.40)),
    )

    def __post_init__(self):
        check(len(set(self.levels)) == len(self.levels) and self.levels, "levels", "need distinct level names")
        last = 0.0
        for i, phase in enumerate(self.phases):
            check(last < phase.until <= 1.0, f"phases[{i}].until",
                  f"phase ends must increase within (0, 1], got {phase.until} after {last}")
            check(len(phase.mix) == len(self.levels), f"phases[{i}].mix",
                  f"needs one share per level {list(self.levels)}, got {len(phase.mix)}")
            check(all(m >= 0 for m in phase.mix) and abs(sum(phase.mix) - 1.0) < 1e-6, f"phases[{i}].mix",
                  f"shares must be >= 0 and sum to 1, got {list(phase.mix)}")
            last = phase.until
        check(abs(last - 1.0) < 1e-9, "phases", "the last phase must end at until: 1.0")


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
    every: int = 0  # steps between evals; 0 = only at the end
    max_batches: int | None = None
    patience: int | None = None  # early stopping after this many evals without improvement
    min_delta: float = 0.0
    # GRPO: held-out prompts are generated and scored by the reward functions
    temperature: float | None = None  # None = rollout.temperature; 0 = greedy
    samples_per_prompt: int = 1

    def __post_init__(self):
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
    data: DataConfig
    output_dir: str
    seed: int = 42
    device: Literal["auto", "cuda", "rocm", "npu", "cpu"] = "auto"
    finetuning: Finetuning = "full"
    lora: LoraConfig | None = None
    qlora: QuantConfig | None = None
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        _check_finetuning(self)
        check(not self.data.packing or self.data.template in ("alpaca", "chat"), "data.packing", "unsupported")


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
    kv_cache_gb: float = 1.0  # CPU engines: KV cache cap (vLLM takes 16 GiB otherwise)
    sync_bucket_mb: int = 256  # weight sync through the Ray object store, one bucket at a time
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


@dataclass(frozen=True)
class RewardConfig:
    fn: str  # "package.module:function" or "path/to/file.py:function" (relative to the recipe)
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    timeout_s: float | None = 30.0
    on_error: dict[str, float] | None = None  # {default: 0.0}: count errors instead of stopping

    def __post_init__(self):
        check(":" in self.fn, "fn", f"expected 'module.path:function' or 'file.py:function', got {self.fn!r}")
        check(self.on_error is None or set(self.on_error) == {"default"}, "on_error",
              "expected {default: <number>}")


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
    kl: Literal["k1", "k2", "k3"] = "k3"
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    advantage: Literal["grpo", "dr_grpo", "batch"] = "grpo"
    advantage_eps: float = 1e-4
    async_generation: bool = False  # generate step k+1 while step k trains (one step off-policy)
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups and refill
    max_refill_rounds: int = 3
    mask_truncated: bool = False
    overlong_buffer: int = 0  # DAPO soft overlong punishment buffer (tokens); 0 = off
    overlong_penalty: float = 1.0

    def __post_init__(self):
        check(self.group_size >= 2, "group_size", f"group-relative advantages need >= 2, got {self.group_size}")
        check(self.steps >= 1 and self.prompts_per_step >= 1 and self.epochs >= 1, "steps", "must be >= 1")
        rollouts = self.prompts_per_step * self.group_size
        per_mb = rollouts // max(self.mini_batches, 1)
        check(rollouts % self.mini_batches == 0, "mini_batches",
              f"{rollouts} completions per step (prompts_per_step x group_size) do not split into "
              f"{self.mini_batches} mini-batches")
        check(per_mb % (self.micro_batch_size * self.num_learners) == 0, "micro_batch_size",
              f"a mini-batch of {per_mb} completions does not divide into micro_batch_size "
              f"{self.micro_batch_size} x num_learners {self.num_learners}")
        check(0 <= self.epsilon_low < 1 and self.epsilon_high >= 0, "epsilon_low", "clip ranges must be >= 0")
        check(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")


@dataclass(frozen=True)
class GRPOConfig:
    model: ModelConfig
    data: DataConfig
    output_dir: str
    rewards: tuple[RewardConfig, ...]
    seed: int = 42
    device: Literal["auto", "cuda", "rocm", "npu", "cpu"] = "auto"
    finetuning: Finetuning = "full"
    lora: LoraConfig | None = None
    qlora: QuantConfig | None = None
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
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


__all__ = ["ConfigError", "Invalid", "load", "SFTConfig", "GRPOConfig", "STAGES"]
