"""The recipe sections the stages share: model, adapters, data, curriculum, optimiser, DeepSpeed,
rollout engines, evaluation, checkpoints, logging, Ray.

Each stage owns its recipe type (`sft/config.py: SFTConfig`, `grpo/config.py: GRPOConfig`),
built from these parts; `rlkit.stages.load` reads a recipe into it. Every section is a frozen
dataclass whose `__post_init__` checks its values (`check(cond, key, message)`), so a mistake
is one line naming the file and the key before any work starts (see `rlkit.recipe`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from rlkit.accel import Kind
from rlkit.data.curriculum import DEFAULT_LEVELS, DEFAULT_PHASES, validate_phases
from rlkit.data.schema import ROW_FORMATS
from rlkit.data.templates import TEMPLATES
from rlkit.recipe import check, replaced
from rlkit.tiny import SIZES, VLM

# The accepted values come from the code that reads them (the loader, the templates, tiny models).
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
DataFormat = Literal[ROW_FORMATS]
Template = Literal[("auto", *TEMPLATES)]
TinyName = Literal[(*SIZES, VLM)]
Device = Literal[("auto", *get_args(Kind))]
Finetuning = Literal["full", "lora", "qlora"]


@dataclass(frozen=True)
class ModelConfig:
    path: str  # local HF model directory (or hub id where a hub is reachable)
    tokenizer: str | None = None  # defaults to `path`
    dtype: Dtype = "auto"  # auto: bf16 where the device supports it, else fp32
    trust_remote_code: bool = False  # run the model repo's own code (HF trust_remote_code)
    attn_implementation: str | None = None  # e.g. sdpa, flash_attention_2 (None: transformers' default)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% slower
    # Liger's Triton RMSNorm, SwiGLU and RoPE in the learners (rlkit/model/kernels.py): auto = on CUDA where
    # liger-kernel is installed and has the model's family; liger = required (one line where it cannot apply)
    kernels: Literal["auto", "liger", "none"] = "auto"
    # build an untrained tiny model offline at `path` when nothing is there (the demo's recipes)
    build_tiny_if_missing: TinyName | None = None
    # vision-language models (LLaMA-Factory's keys): keep the vision tower's weights (LoRA: no adapters there)
    freeze_vision_tower: bool = True
    # vision-language models: keep the projector between the towers (false: trained; whole under LoRA)
    freeze_multi_modal_projector: bool = True

    RENAMED: ClassVar[dict[str, str]] = {"tiny": "build_tiny_if_missing"}


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16  # LoRA rank
    alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.05  # dropout on the LoRA input
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # module names that get adapters

    def __post_init__(self):
        check(self.r > 0, "r", f"LoRA rank must be > 0, got {self.r}")
        check(self.alpha > 0, "alpha", f"must be > 0 (the adapter's scale is alpha / r), got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(len(self.target_modules) > 0, "target_modules", "name at least one module")
        check("all-linear" not in self.target_modules or len(self.target_modules) == 1, "target_modules",
              "all-linear (every linear layer) stands alone: name it, or the modules")


@dataclass(frozen=True)
class QuantConfig:
    """QLoRA 4-bit base weights (bitsandbytes)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit type of the frozen base weights
    double_quant: bool = True  # quantise the quantisation constants too
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"  # dtype the 4-bit layers compute in


@dataclass(frozen=True)
class DataConfig:
    """Data both stages read. SFT rows or GRPO prompts; the source kind (JSON/JSONL, parquet,
    CSV, Arrow, shards, dataset_info.json, a save_to_disk folder) comes from the path, `format`
    is the row schema."""

    # training rows: a JSON / JSONL (.gz too) / parquet / CSV / TSV / Arrow file, a glob or folder of
    # them, dataset_info.json, a save_to_disk folder
    train: str
    eval: str | None = None  # held-out rows, same kinds (needed by eval.every)
    format: DataFormat = "auto"  # row schema; auto: from the first row
    dataset: str | None = None  # entry name in a dataset_info.json
    # split of `train` in a save_to_disk DatasetDict or a folder of the hub's train-*/test-* shards
    # (null: train, or the only one)
    split: str | None = None
    eval_split: str | None = None  # split of `eval`, the same way
    # auto: the tokenizer's chat template for chat rows (messages), the seeds' alpaca template for
    # alpaca and plain-text rows; final/'s tokenizer gets the template trained (see templates.py)
    template: Template = "auto"
    skip_bad_rows: bool = False  # drop invalid rows with a count instead of stopping at the first
    # write the offline arithmetic task (with this seed) next to `train` when `train` is missing
    build_synthetic_if_missing: int | None = None

    RENAMED: ClassVar[dict[str, str]] = {"synthetic_seed": "build_synthetic_if_missing"}

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "cutoff_len": "SFT only: GRPO prompts are not cut, completions end at rollout.max_tokens",
        "packing": "SFT only: GRPO packs its micro-batches with grpo.max_tokens_per_micro_batch",
        "mask_history": "SFT only: GRPO trains on its own completions, not on the data's turns"}


@dataclass(frozen=True)
class PhaseConfig:
    until: float  # end of this phase as a fraction of training (last one is 1.0)
    mix: tuple[float, ...]  # share of each level, in `levels` order; sums to 1


@dataclass(frozen=True)
class CurriculumConfig:
    # off unless a recipe asks (the seed recipes do); when on and no row has a `difficulty`, it
    # turns itself off with one warning; when off, a `difficulty` column is not read
    enabled: bool = False
    levels: tuple[str, ...] = DEFAULT_LEVELS  # difficulty levels in order (numeric difficulties are bucketed into them)
    phases: tuple[PhaseConfig, ...] = tuple(PhaseConfig(until, mix) for until, mix in DEFAULT_PHASES)

    def __post_init__(self):
        validate_phases(self.levels, self.schedule)  # the sampler's own check; errors name the key

    @property
    def schedule(self) -> list[tuple[float, tuple[float, ...]]]:
        """`(until, mix)` per phase, as the sampler takes them."""
        return [(p.until, p.mix) for p in self.phases]


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-5  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW eps
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warmup
    warmup_steps: int = 0  # linear warmup steps
    warmup_ratio: float = 0.0  # warmup as a share of the steps (instead of warmup_steps)
    min_lr_ratio: float = 0.0  # floor of the decay, as a share of lr
    max_grad_norm: float = 1.0  # 0 turns clipping off

    def __post_init__(self):
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"AdamW's betas must be in [0, 1), got {self.betas}")
        check(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        check(self.warmup_steps == 0 or self.warmup_ratio == 0.0, "warmup_ratio",
              "set warmup_steps or warmup_ratio, not both")


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2, 3] = 0  # DeepSpeed ZeRO: 0 off, 1 optimizer, 2 + gradients, 3 + parameters sharded
    offload_optimizer: bool = False  # optimizer states in CPU memory (ZeRO >= 1)
    offload_param: bool = False  # parameters in CPU memory (ZeRO-3)
    torch_adam: bool = True  # torch AdamW instead of DeepSpeed's JIT-compiled fused/CPU Adam
    dist_timeout_s: int = 600  # collective timeout: a hang fails (a cut-off host's learner exits after this or 60 s)
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the generated DeepSpeed config
    # a DeepSpeed JSON (e.g. ds_config.json, beside the recipe or from the working folder), folded
    # into these keys, model.dtype, optim.* and the micro-batch size at load (see ds_config.py)
    config: str | None = None

    def __post_init__(self):
        check(not self.offload_param or self.zero_stage == 3, "offload_param", "needs zero_stage: 3")
        check(not self.offload_optimizer or self.zero_stage >= 1, "offload_optimizer", "needs zero_stage >= 1")

    def flat_bf16(self, precision: str) -> bool:
        """Whether training in `precision` ("bf16", "fp16", "fp32") runs DeepSpeed's BF16_Optimizer:
        bf16 at ZeRO 0 or 1 without offload (`learner/ds_config.py`)."""
        return precision == "bf16" and self.zero_stage <= 1 and not self.offload_optimizer


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (needs `data.eval`): before the first step, every `every` steps and
    after the last step; `every: 0` = only before the first and after the last, in both stages."""

    every: int = 0  # held-out evaluation every N steps (0: before the first and after the last only)

    def __post_init__(self):
        check(self.every >= 0, "every", f"must be >= 0, got {self.every}")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = none (only final/)
    keep_last: int = 2  # checkpoints kept (plus SFT's best one)
    resume: str = "auto"  # auto | never | a checkpoint directory
    # resume even though the model, data or batch shape differ from the checkpoint's config.yaml
    force_resume: bool = False

    def __post_init__(self):
        check(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 1  # metrics to the console every N steps (metrics.jsonl gets every step)
    tensorboard: bool = True  # TensorBoard events in output_dir/tensorboard
    wandb: bool = False  # log to Weights & Biases (needs wandb installed and logged in)
    wandb_project: str = "rlkit"  # wandb project; the run is named after output_dir
    # console progress: auto = bar on a terminal, plain lines otherwise
    progress: Literal["auto", "bar", "plain", "none"] = "auto"
    # GRPO: completions written to rollouts.jsonl at each logging step (prompt, completion, rewards
    # per function, advantage; one from each prompt group in turn), as TRL's log_completions; 0 = off
    completions: int = 4

    def __post_init__(self):
        check(self.every >= 1, "every", f"must be >= 1, got {self.every}")
        check(self.completions >= 0, "completions", f"must be >= 0 (0 = off), got {self.completions}")


@dataclass(frozen=True)
class RoleResources:
    """Custom Ray resources that each actor of a role asks for beside its CPUs and devices: the
    labels a cluster gives its nodes (`ray start --resources='{"judge": 1}'`, a node type, an
    accelerator Ray does not know), so that a role runs only where they are."""

    learner: dict[str, float] = field(default_factory=dict)  # each learner rank's actor
    engine: dict[str, float] = field(default_factory=dict)  # each separate rollout engine's actor
    teacher: dict[str, float] = field(default_factory=dict)  # the distillation teacher's own actor (placement: actor)

    def __post_init__(self):
        for role in ("learner", "engine", "teacher"):
            for name, amount in getattr(self, role).items():
                check(name not in ("CPU", "GPU", "memory", "object_store_memory") and not name.startswith("node:"),
                      f"{role}.{name}", "is set by ray.cpus_per_actor, the device or distill.node: list custom "
                      "resources here")
                check(isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0,
                      f"{role}.{name}", f"must be a number > 0, got {amount!r}")


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # "auto", HOST:PORT or ray://... to join a cluster; None starts a local one
    num_cpus: int | None = None  # for the local instance
    cpus_per_actor: float = 1.0  # Ray CPUs reserved per learner / engine actor
    # where the learners' bundles (and, apart, the engines') go: pack = as few nodes as possible,
    # spread = across nodes; strict_pack = one node or none, strict_spread = one bundle per node
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    # custom resources per role ({learner: {judge: 1}}): each actor of that role runs where they are
    resources: RoleResources = field(default_factory=RoleResources)

    def __post_init__(self):
        check(self.num_cpus is None or self.num_cpus >= 1, "num_cpus", f"must be >= 1, got {self.num_cpus}")
        check(self.cpus_per_actor > 0, "cpus_per_actor", f"must be > 0, got {self.cpus_per_actor}")


@dataclass(frozen=True)
class StageConfig:
    """The keys every stage recipe has; a stage's type adds its `data` section (kw-only), its own
    sections and rules (`sft/config.py`, `grpo/config.py`)."""

    model: ModelConfig
    # run folder: config.yaml, rlkit.log, metrics, checkpoints, final/ (relative to the working directory)
    output_dir: str
    overwrite: bool = False  # a fresh run may replace another run's outputs in output_dir
    # on an accelerator, a plan whose memory estimate exceeds a device: warn (one line), error (stop before
    # launch) or off; `rlkit estimate` shows the parts
    memory_check: Literal["warn", "error", "off"] = "warn"
    seed: int = 42  # seeds sampling, shuffling, generation, initialisation
    device: Device = "auto"  # auto: the accelerator this host has (CUDA, ROCm, NPU), else CPU
    finetuning: Finetuning = "full"  # full, lora (needs a lora section) or qlora (4-bit base + LoRA)
    lora: LoraConfig | None = None
    qlora: QuantConfig | None = None
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    # keys by their peers' names (TRL, LLaMA-Factory, HF Trainer, verl, OpenRLHF), for the unknown-key hint;
    # a stage adds its own
    PEER_NAMES: ClassVar[dict[str, str]] = {
        "learning_rate": "optim.lr", "lr_scheduler_type": "optim.scheduler", "model_name_or_path": "model.path",
        "lora_rank": "lora.r", "lora_alpha": "lora.alpha", "lora_target": "lora.target_modules",
        "deepspeed_stage": "deepspeed.zero_stage", "finetuning_type": "finetuning"}
    # what a resumed run may not change from its checkpoint's config (checkpoint.force_resume); a stage adds its own
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        "stage", "model", "finetuning", "lora", "qlora", "data.train", "data.format", "data.dataset",
        "data.template", "data.skip_bad_rows", "curriculum", "deepspeed.zero_stage")

    def __post_init__(self):
        check_finetuning(self)

    def models(self) -> dict[str, ModelConfig]:
        """The models this recipe names by their keys (a stage adds its own: GRPO its distillation
        teacher), for GGUF import and the path checks before launch."""
        return {"model": self.model}

    def with_models(self, models: dict[str, ModelConfig]) -> StageConfig:
        """This recipe with the models at those keys (of `models()`) replaced."""
        return functools.reduce(lambda cfg, item: replaced(cfg, *item), models.items(), self)


def check_finetuning(cfg: Any) -> None:
    """Cross-section rules of a stage recipe's `finetuning`, `lora`, `qlora` and `deepspeed`, and
    `eval.every` (it needs `data.eval`)."""
    check(cfg.finetuning == "full" or cfg.lora is not None, "lora",
          f"finetuning: {cfg.finetuning} needs a lora section (r, alpha, target_modules)")
    check(cfg.qlora is None or cfg.finetuning == "qlora", "qlora",
          "a qlora section needs finetuning: qlora (QLoRA trains LoRA adapters on 4-bit weights)")
    check(cfg.finetuning != "qlora" or cfg.deepspeed.zero_stage != 3, "deepspeed.zero_stage",
          "QLoRA 4-bit weights cannot be partitioned by ZeRO-3; use zero_stage 0-2")
    check(cfg.eval.every == 0 or cfg.data.eval is not None, "eval.every",
          f"evaluates on data.eval every {cfg.eval.every} steps, but data.eval is not set: add data.eval "
          "(held-out rows) or set eval.every: 0")
