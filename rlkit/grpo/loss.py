"""GRPO policy loss, KL estimators and token-level helpers (pure tensor math, torch only).

Shapes: B completions, T completion positions (right-padded), V vocabulary.
``logp``, ``old_logp``, ``ref_logp``, ``mask``: [B, T]; ``mask`` is 1 on completion tokens
that count in the loss, 0 on padding (and on masked/truncated completions). ``advantages``: [B]
(or [B, T] for per-token advantages). Log-probs are natural logs (nats).

The per-token objective and the four aggregations equal TRL 1.16
(``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``, token-level importance
sampling) *except* that :func:`policy_loss` applies no gradient-accumulation / world-size
scaling. TRL hands the HF Trainer a pre-scaled loss; to reproduce TRL's number:

* ``grpo`` / ``bnpo`` / ``dr_grpo``: ``trl_loss = ours / gradient_accumulation_steps``.
* ``dapo``: TRL divides by ``num_items_in_batch_gen / num_processes * GA / steps_per_generation``
  where ``num_items_in_batch_gen`` is the loss-token count of the whole generation batch summed
  over ranks; pass that expression as ``num_items_in_batch`` here.

To get a *global token mean* for ``dapo`` under an engine that averages gradients over P ranks
and divides the loss by GA (DeepSpeed's default), pass
``num_items_in_batch = tokens_in_optimizer_step_all_ranks / (P * GA)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# The names a recipe may use (`grpo.loss_type`, `grpo.kl`); the recipe types are built from them.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_KINDS = ("k1", "k2", "k3")
LossType = Literal[LOSS_TYPES]
KLKind = Literal[KL_KINDS]


@dataclass(frozen=True)
class LossOutput:
    """``loss``: scalar with grad. Metrics: detached 0-dim tensors, token means over ``mask``.

    clip_frac_low: ratio < 1 - epsilon_low and A < 0; clip_frac_high: ratio > 1 + epsilon_high
    and A > 0; clip_frac: either (TRL ``clip_ratio/{low,high,region}_mean``). kl_mean is None
    without ``ref_logp``; entropy is None without ``entropies``.
    """

    loss: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    clip_frac: Tensor
    ratio_mean: Tensor
    kl_mean: Tensor | None = None
    entropy: Tensor | None = None


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With ``d = ref_logp - logp``: k1 = -d; k2 = d**2 / 2; k3 = exp(d) - d - 1 (>= 0, TRL's).
    Shapes broadcast; returns ``logp``'s shape, in nats.
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _check_shapes(logp: Tensor, mask: Tensor, advantages: Tensor, **others: Tensor | None) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logp shape {tuple(logp.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [B]={tuple(logp.shape[:1])} or [B, T]={tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )


def policy_loss(logp: Tensor, old_logp: Tensor | None, advantages: Tensor, mask: Tensor, *, epsilon_low: float = 0.2,
                epsilon_high: float = 0.2, ref_logp: Tensor | None = None, beta: float = 0.0, kl: KLKind = "k3",
                loss_type: LossType = "grpo", max_completion_length: int | None = None, delta: float | None = None,
                num_items_in_batch: float | Tensor | None = None, entropies: Tensor | None = None) -> LossOutput:
    """Clipped-surrogate GRPO loss (to minimise) with optional KL penalty.

    Per token, with ratio r = exp(logp - old_logp) and A the advantage:
    ``l = -min(r' * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL_kind``,
    where r' = min(r, delta) if ``delta`` is set (INTELLECT-2 two-sided clipping, TRL ``delta``;
    use delta > 1 + epsilon_high), else r. ``old_logp=None`` means on-policy (``logp.detach()``).

    Aggregation of ``l * mask`` (S = its sum):
        grpo:    mean over tokens per sequence, then mean over the B sequences;
        bnpo:    S / (number of mask tokens in this batch);
        dr_grpo: S / (B * max_completion_length)  (``max_completion_length`` required);
        dapo:    S / num_items_in_batch  (default: mask tokens in this batch, i.e. = bnpo).
    Denominators are clamped to >= 1 as in TRL. No grad-accumulation scaling: see module doc.

    ``entropies`` [B, T] (optional) is only reported, not added to the loss.
    """
    _check_shapes(logp, mask, advantages, old_logp=old_logp, ref_logp=ref_logp, entropies=entropies)
    _check_options(loss_type, beta, ref_logp, max_completion_length, delta, epsilon_high)
    mask = mask.to(logp.dtype)
    if old_logp is None:
        old_logp = logp.detach()
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)

    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * adv, clipped * adv)

    per_token_kl = None
    if ref_logp is not None:
        per_token_kl = kl_penalty(logp, ref_logp, kl)
        if beta != 0.0:
            per_token = per_token + beta * per_token_kl

    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_items_in_batch)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(logp.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(logp.dtype)
        return LossOutput(loss, _masked_mean(low, mask), _masked_mean(high, mask),
                          _masked_mean(torch.maximum(low, high), mask), _masked_mean(ratio, mask),
                          kl_mean=None if per_token_kl is None else _masked_mean(per_token_kl, mask),
                          entropy=None if entropies is None else _masked_mean(entropies, mask))


def _check_options(loss_type: str, beta: float, ref_logp: Tensor | None, max_completion_length: int | None,
                   delta: float | None, epsilon_high: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (reference-model log-probs)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its fixed normaliser)")
    if delta is not None and delta <= 1.0 + epsilon_high:
        raise ValueError(f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high}")


def aggregate(per_token: Tensor, mask: Tensor, loss_type: LossType, max_completion_length: int | None = None,
              num_items_in_batch: float | Tensor | None = None) -> Tensor:
    """The scalar loss from per-token losses [B, T] and the float mask [B, T] (see `policy_loss`
    for the four aggregations); denominators are clamped to >= 1 as in TRL."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    n = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=per_token.dtype)
    return masked.sum() / n.clamp(min=1.0)  # dapo


# --- normalisers and reward shaping --------------------------------------------------


def dapo_normaliser(tokens: int, world_size: int, grad_accum: int) -> float:
    """``num_items_in_batch`` for ``dapo`` that makes the loss a token mean over a whole optimizer
    step when the engine averages gradients over ``world_size`` ranks and divides each
    micro-batch's loss by ``grad_accum`` (DeepSpeed's default): ``max(tokens, 1) / (world_size *
    grad_accum)``, ``tokens`` = loss tokens of the optimizer step summed over all ranks."""
    return max(tokens, 1) / (world_size * grad_accum)


def soft_overlong_penalty(
    lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Eq. 13), float [B] from completion lengths [B] (tokens).

    0 if len <= max_len - buffer_len; ``(max_len - buffer_len - len) / buffer_len * factor``
    (linear from 0 to -factor) up to max_len; -factor beyond. Equals TRL's
    ``get_soft_overlong_punishment(max_len, buffer_len)`` for factor 1.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    start = max_len - buffer_len
    lengths = lengths.to(torch.get_default_dtype())
    ramp = (start - lengths) / buffer_len
    out = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    out = torch.where(lengths > max_len, torch.full_like(ramp, -1.0), out)
    return out * penalty_factor
