"""The DPO recipe type: the shared sections (`rlkit/config.py`), the preference data, the
training and evaluation sections SFT has, and `dpo:` (TRL's `DPOConfig` names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlkit.config import DataConfig, EvalConfig, StageConfig
from rlkit.dpo.loss import DPO_LOSSES, F_DIVERGENCE_LOSSES, REFERENCE_FREE, DPOTerms
from rlkit.recipe import check
from rlkit.sft.config import SFTTrainConfig


@dataclass(frozen=True)
class PreferenceDataConfig(DataConfig):
    cutoff_len: int = 1024  # tokens of prompt + response per side (TRL's max_length); longer sides are cut
    # which end of prompt + response a side over cutoff_len keeps (TRL's truncation_mode)
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "packing": "SFT only: DPO's rows go padding-free with dpo.padding_free",
        "mask_history": "SFT only: a pair's target is its last (chosen or rejected) turn"}

    def __post_init__(self):
        check(self.cutoff_len >= 8, "cutoff_len", f"must be >= 8, got {self.cutoff_len}")
        check(self.format == "auto", "format", "preference data is read with format auto (the columns say "
              "which form it is)")


@dataclass(frozen=True)
class DPOLossConfig:
    """TRL 1.16's `DPOConfig` keys (the loss, the reference, padding-free rows), their defaults and checks."""

    loss_type: tuple[str, ...] = ("sigmoid",)  # one or several (combined with loss_weights: RPO = sigmoid + sft)
    loss_weights: tuple[float, ...] | None = None  # one per loss_type (default: 1.0 each)
    beta: float = 0.1  # strength of the KL constraint against the reference (0.1-0.5 typical)
    label_smoothing: float = 0.0  # robust / exo_pair / aot: the share of flipped preference labels assumed
    # f-DPO: the divergence the KL constraint generalises to (reverse_kl: DPO's own)
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5  # alpha of the alpha divergence
    ld_alpha: float | None = None  # LD-DPO: weight of the tokens past the shorter side's length
    discopop_tau: float = 0.05  # discopop's mixing temperature
    # the reference-free losses (loss_type orpo, simpo, cpo: TRL's experimental ORPO and CPO trainers)
    cpo_alpha: float = 1.0  # simpo / cpo: weight of the chosen side's NLL (SimPO proper: 0)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    use_weighting: bool = False  # WPO: each pair weighted by its sides' length-normalised probabilities
    # the reference's logprobs of every pair computed once before the first step (by the starting
    # policy itself: full fine-tuning then holds no frozen copy), kept with the checkpoints
    precompute_ref_log_probs: bool = False
    # TR-DPO: every ref_model_sync_steps steps the reference becomes alpha * policy + (1 - alpha) * reference
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6  # TR-DPO: the policy's share of the moved reference
    ref_model_sync_steps: int = 512  # TR-DPO: steps between moves of the reference
    padding_free: bool = False  # each micro-batch's rows as one row without padding (attention per row)

    def __post_init__(self):
        known = (*DPO_LOSSES, *REFERENCE_FREE)
        unknown = [k for k in self.loss_type if k not in known]
        check(not unknown and len(self.loss_type) > 0, "loss_type",
              f"unknown {unknown[0]!r}; expected one or more of {', '.join(known)}" if unknown
              else "name at least one loss type")
        free = [k for k in self.loss_type if k in REFERENCE_FREE]
        check(not free or len(self.loss_type) == 1, "loss_type",
              f"{(free or ['it'])[0]} needs no reference and is not combined with other losses; name it alone")
        check(self.cpo_alpha >= 0, "cpo_alpha", f"must be >= 0, got {self.cpo_alpha}")
        check(self.loss_weights is None or len(self.loss_weights) == len(self.loss_type), "loss_weights",
              f"one weight per loss_type: {len(self.loss_type)} types, {len(self.loss_weights or ())} weights")
        check(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        check(self.f_divergence_type == "reverse_kl" or set(self.loss_type) <= F_DIVERGENCE_LOSSES,
              "f_divergence_type", f"{self.f_divergence_type} generalises only the losses built on the chosen-"
              f"rejected difference ({', '.join(sorted(F_DIVERGENCE_LOSSES))}), not {list(self.loss_type)}")
        check("exo_pair" not in self.loss_type or self.label_smoothing > 0, "label_smoothing",
              "exo_pair needs label_smoothing > 0 (its paper uses 1e-3)")
        check("robust" not in self.loss_type or 0 <= self.label_smoothing < 0.5, "label_smoothing",
              f"robust needs label_smoothing in [0, 0.5), got {self.label_smoothing}")
        check(self.ld_alpha is None or 0.0 <= self.ld_alpha <= 1.0, "ld_alpha",
              f"must be in [0, 1], got {self.ld_alpha}")
        sorting = sorted({"aot", "aot_unpaired"} & set(self.loss_type))
        check(not (self.use_weighting and sorting), "use_weighting",
              f"{(sorting or [''])[0]} sorts the pairs' ratios, so a pair's weight would not meet its own loss (TRL "
              "refuses it too): set use_weighting: false")
        for key in ("use_weighting", "precompute_ref_log_probs", "sync_ref_model"):
            check(not (getattr(self, key) and free), key, f"{(free or [''])[0]} is not a DPO loss on a reference: "
                  f"set {key}: false")
        check(not (self.sync_ref_model and self.precompute_ref_log_probs), "sync_ref_model",
              "a reference that moves (TR-DPO) cannot be computed once before training: set "
              "precompute_ref_log_probs: false")
        check(0.0 < self.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha",
              f"must be in (0, 1], got {self.ref_model_mixup_alpha}")
        check(self.ref_model_sync_steps >= 1, "ref_model_sync_steps", f"must be >= 1, got {self.ref_model_sync_steps}")

    @property
    def reference_free(self) -> bool:
        """ORPO, SimPO or CPO: no reference model, its logprobs never computed."""
        return self.loss_type[0] in REFERENCE_FREE

    def terms(self) -> DPOTerms:
        return DPOTerms(self.loss_type, self.loss_weights, self.beta, self.label_smoothing, self.f_divergence_type,
                        self.f_alpha_divergence_coef, self.ld_alpha, self.use_weighting, self.discopop_tau)


@dataclass(frozen=True)
class DPOEvalConfig(EvalConfig):
    max_batches: int | None = None  # evaluate on this many micro-batches only (None: every held-out pair)

    READ_ELSEWHERE: ClassVar[dict[str, str]] = {
        "temperature": "GRPO only: DPO evaluates its loss and reward accuracy, it does not generate",
        "samples_per_prompt": "GRPO only: DPO evaluates its loss and reward accuracy, it does not generate"}


@dataclass(frozen=True, kw_only=True)
class DPOConfig(StageConfig):
    data: PreferenceDataConfig
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)  # micro_batch_size counts pairs
    eval: DPOEvalConfig = field(default_factory=DPOEvalConfig)
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)

    PEER_NAMES: ClassVar[dict[str, str]] = {
        **StageConfig.PEER_NAMES, "num_train_epochs": "train.epochs", "pref_beta": "dpo.beta",
        "pref_loss": "dpo.loss_type", "per_device_train_batch_size": "train.micro_batch_size",
        "gradient_accumulation_steps": "train.grad_accum", "max_length": "data.cutoff_len",
        "truncation_mode": "data.truncation_mode", "rpo_alpha": "dpo.loss_weights", "simpo_gamma": "dpo.simpo_gamma",
        "cpo_alpha": "dpo.cpo_alpha", "use_weighting": "dpo.use_weighting",
        "precompute_ref_log_probs": "dpo.precompute_ref_log_probs", "sync_ref_model": "dpo.sync_ref_model",
        "ref_model_mixup_alpha": "dpo.ref_model_mixup_alpha", "ref_model_sync_steps": "dpo.ref_model_sync_steps",
        "padding_free": "dpo.padding_free"}
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        *StageConfig.RESUME_FIXED, "data.cutoff_len", "data.truncation_mode", "train.num_learners",
        "train.micro_batch_size", "train.grad_accum", "dpo")

    def __post_init__(self):
        super().__post_init__()
        check(not (self.ray.resources.engine or self.ray.resources.teacher), "ray.resources",
              "a DPO run has learners only: put their resources under ray.resources.learner")
        check(not (self.dpo.sync_ref_model and self.finetuning != "full"), "dpo.sync_ref_model",
              f"with {self.finetuning} the reference is the policy with its adapters disabled, not a copy that can "
              "move: set sync_ref_model: false, or finetuning: full")
