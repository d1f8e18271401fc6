"""Rollout correction: the gap between the sampling engine and the learner (pure tensor math, torch only).

The engine (vLLM) samples completions and reports each token's logprob (`engine_logp`); the
learner recomputes the same tokens' logprobs under the policy before the step's first update
(`learner_logp`, the "old" policy of the PPO ratio). The two differ through kernels and precision
(bf16 vLLM vs the trainer), through temperature handling, and, with bounded staleness, because
the engine held an older policy. The correction weighs each token (or sequence) of the policy
loss by the importance ratio ``rho = pi_learner / pi_engine``, bounded:

    token_truncate:     rho per token, clipped to [clip_min, clip_max]   (TIS)
    token_mask:         rho per token, 0 outside [clip_min, clip_max]     (MIS; ICEPOP with both bounds)
    sequence_truncate:  rho of the whole sequence (product over its tokens), clipped
    sequence_mask:      the sequence's rho, 0 (sequence dropped) outside [clip_min, clip_max]
    none:               no weights (the metrics are still computed)

A bound of None is open. These equal TRL 1.16's ``vllm_importance_sampling_mode`` /
``_clip_min`` / ``_clip_max`` (``GRPOTrainer._generate_and_score_completions``); tokens with a
NaN engine logprob get rho = 1, as there.

Shapes: B completions, T positions; logprobs and ``mask`` [B, T] (mask 1 on loss tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
CorrectionMode = Literal[CORRECTIONS]

# The metric names, always reported (`grpo/objective.py`): names ending in _max / _min are reduced
# with max / min over micro-batches and ranks, the rest averaged.
MISMATCH_METRICS = ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/kl",
                    "is/ratio_mean", "is/ratio_min", "is/ratio_max", "is/corrected_frac")


@dataclass(frozen=True)
class Correction:
    """``weights``: detached [B, T] (token modes) or [B, 1] (sequence modes), None for ``none``.
    ``metrics``: detached 0-dim tensors named as in MISMATCH_METRICS."""

    weights: Tensor | None
    metrics: dict[str, Tensor]


@torch.no_grad()
def rollout_correction(learner_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: CorrectionMode = "none",
                       clip_min: float | None = None, clip_max: float | None = None) -> Correction:
    """The correction weights of ``mode`` and the mismatch metrics (see module doc).

    Metrics over the loss tokens (sequences with at least one, for sequence-level ratios):
    |engine - learner| logprob mean and max (nats); ``mismatch/kl`` = KL(engine || learner) by the
    k3 estimator ``exp(d) - d - 1`` with d = learner - engine (>= 0, 0 iff identical); the raw ratio
    rho's mean/min/max (per token for token modes and ``none``, per sequence for sequence modes); and
    the fraction of those tokens/sequences whose weight the bounds changed (masked or truncated).
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction mode must be one of {CORRECTIONS}, got {mode!r}")
    mask = mask.to(learner_logp.dtype)
    diff = torch.nan_to_num((learner_logp - engine_logp) * mask, nan=0.0)
    sequence = mode.startswith("sequence")
    log_rho = diff.sum(-1, keepdim=True) if sequence else diff
    rho = torch.exp(log_rho)
    weights = None
    if mode.endswith("truncate"):
        weights = torch.clamp(rho, min=clip_min, max=clip_max)
    elif mode.endswith("mask"):
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        weights = rho.masked_fill((rho < lo) | (rho > hi), 0.0)
    valid = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype) if sequence else mask
    changed = torch.zeros_like(rho) if weights is None else (weights != rho).to(rho.dtype)
    return Correction(weights, {**mismatch_metrics(diff, mask), **_ratio_metrics(rho, valid, changed)})


def mismatch_metrics(diff: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """|diff| mean/max and the k3 KL estimate over ``mask`` of ``diff`` = (learner - engine) * mask."""
    n = mask.sum().clamp(min=1.0)
    k3 = torch.exp(diff) - diff - 1  # 0 off the mask: diff is 0 there
    return {"mismatch/logp_abs_diff_mean": diff.abs().sum() / n,
            "mismatch/logp_abs_diff_max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
            "mismatch/kl": k3.sum() / n}


def _ratio_metrics(rho: Tensor, valid: Tensor, changed: Tensor) -> dict[str, Tensor]:
    n = valid.sum().clamp(min=1.0)
    on = valid.bool()
    if not on.any():
        one = rho.new_ones(())
        return {"is/ratio_mean": one, "is/ratio_min": one, "is/ratio_max": one, "is/corrected_frac": 0 * one}
    return {"is/ratio_mean": (rho * valid).sum() / n, "is/ratio_min": rho[on].min(), "is/ratio_max": rho[on].max(),
            "is/corrected_frac": (changed * valid).sum() / n}


@torch.no_grad()
def off_policy_mask(advantages: Tensor, logp: Tensor, engine_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2 off-policy sequence masking (TRL 1.16 ``off_policy_mask_threshold``): keep a
    sequence (1.0) if its advantage is >= 0 or the mean over its loss tokens of
    ``engine_logp - logp`` (a KL(engine || policy) estimate, NaN counted as 0) is <= ``threshold``;
    else 0.0. advantages [B] or [B, 1]; returns [B, 1] in ``mask``'s dtype."""
    mask = mask.to(logp.dtype)
    kl = torch.nan_to_num(engine_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)
