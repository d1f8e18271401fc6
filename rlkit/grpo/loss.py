"""GRPO policy loss, KL estimators and token-level helpers (pure tensor math, torch only).

Shapes: B completions, T completion positions (right-padded), V vocabulary.
``logp``, ``old_logp``, ``ref_logp``, ``mask``: [B, T]; ``mask`` is 1 on completion tokens
that count in the loss, 0 on padding (and on masked/truncated completions). ``advantages``: [B]
(or [B, T] for per-token advantages). Log-probs are natural logs (nats).

The per-token objectives, the importance-sampling levels and the aggregations equal TRL 1.16
(``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``; ``bias_correction_kl`` is TRL's
``use_bias_correction_kl``) *except* that :func:`policy_loss` applies no
gradient-accumulation / world-size scaling. TRL hands the HF Trainer a pre-scaled loss; to
reproduce TRL's number:

* ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``sapo`` / ``luspo``: ``trl_loss = ours / gradient_accumulation_steps``.
* ``dapo`` / ``cispo`` / ``vespo``: TRL divides by
  ``num_items_in_batch_gen / num_processes * GA / steps_per_generation`` where
  ``num_items_in_batch_gen`` is the loss-token count of the whole generation batch summed over
  ranks; pass that expression as ``num_items_in_batch`` here.

To get a *global token mean* for ``dapo`` under an engine that averages gradients over P ranks
and divides the loss by GA (DeepSpeed's default), pass
``num_items_in_batch = tokens_in_optimizer_step_all_ranks / (P * GA)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# The names a recipe may use (`grpo.loss_type`, `grpo.kl`); the recipe types are built from them.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
KL_KINDS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
LossType = Literal[LOSS_TYPES]
KLKind = Literal[KL_KINDS]
ISLevel = Literal[IS_LEVELS]
_TOKEN_MEAN = ("dapo", "cispo", "vespo")  # normalised by num_items_in_batch
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate


@dataclass(frozen=True)
class SoftGates:
    """Parameters of the soft losses (TRL 1.16 defaults): SAPO's gate temperatures for A > 0 and
    A <= 0, VESPO's Gamma weighting ``phi(w) = exp(lam) * w**k * exp(-lam * w)`` for A >= 0 / A < 0."""

    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True)
class LossOutput:
    """``loss``: scalar with grad. Metrics: detached 0-dim tensors, token means over ``mask``
    (sequence means for sequence-level ratios, as TRL).

    clip_frac_low: ratio < 1 - epsilon_low and A < 0; clip_frac_high: ratio > 1 + epsilon_high
    and A > 0; clip_frac: either (TRL ``clip_ratio/{low,high,region}_mean``); for ``cispo`` only
    clip_frac_high = clip_frac = ratio > epsilon_high and A > 0 (TRL ``cispo_clip_ratio``); None
    for the soft losses (``sapo``, ``vespo``). kl_mean is None without ``ref_logp``; entropy is
    None without ``entropies``; phi_mean (VESPO's mean weight) only for ``vespo``.
    """

    loss: Tensor
    clip_frac_low: Tensor | None
    clip_frac_high: Tensor | None
    clip_frac: Tensor | None
    ratio_mean: Tensor
    kl_mean: Tensor | None = None
    entropy: Tensor | None = None
    phi_mean: Tensor | None = None


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
    """Mean over ``mask`` tokens of x [B, T]; for x [B, 1] (one value per sequence) the mean over B."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.mean()
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
                loss_type: LossType = "grpo", importance_sampling_level: ISLevel = "token",
                max_completion_length: int | None = None, delta: float | None = None,
                num_items_in_batch: float | Tensor | None = None, entropies: Tensor | None = None,
                is_weights: Tensor | None = None, keep: Tensor | None = None,
                gates: SoftGates = SoftGates(), bias_correction_kl: bool = False) -> LossOutput:
    """Policy-gradient loss (to minimise) with optional KL penalty.

    The ratio w = exp(logp - old_logp) per token (``importance_sampling_level="token"``) or, for
    GSPO (``"sequence"``), exp of the masked mean of ``logp - old_logp`` per sequence ([B, 1]).
    ``old_logp=None`` means on-policy (``logp.detach()``). Per token, with A the advantage:

        clipped losses (grpo, bnpo, dr_grpo, dapo, luspo):
            ``-min(w' A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A)``, w' = min(w, delta) if
            ``delta`` is set (INTELLECT-2 two-sided clipping; use delta > 1 + epsilon_high), else w;
        cispo (MiniMax-M1): ``-sg(min(w, epsilon_high)) A logp`` (epsilon_high is the cap, e.g. 5);
        sapo: ``-sigmoid(tau (w - 1)) 4 / tau A``, tau = gates.sapo_temperature_pos if A > 0 else _neg;
        vespo: ``-sg(phi(W)) A logp``, W the sequence's product ratio times its ``is_weights``.

    ``is_weights`` ([B, T] or [B, 1], detached: the rollout correction of `correction.py`) and
    ``keep`` ([B, 1] or [B, T] of 0/1: the off-policy sequence mask) multiply the policy term
    (``vespo`` folds ``is_weights`` into W instead). Then ``+ beta * KL_kind(logp, ref_logp)``, the
    KL term times the unclipped ratio w with ``bias_correction_kl`` (TRL's ``use_bias_correction_kl``,
    DeepSeek-V3.2: w's gradient makes k3's the unbiased reverse-KL gradient ``(logp - ref_logp) grad
    logp``, on-policy too, where w is 1 but its gradient is not; ``kl_mean`` is then of the weighted term).

    Averaged as `aggregate` says (dr_grpo needs ``max_completion_length``); no grad-accumulation
    scaling: see module doc.

    ``entropies`` [B, T] (optional) is only reported, not added to the loss.
    """
    _check_shapes(logp, mask, advantages, old_logp=old_logp, ref_logp=ref_logp, entropies=entropies)
    _check_options(loss_type, beta, ref_logp, max_completion_length, delta, epsilon_high, importance_sampling_level)
    mask = mask.to(logp.dtype)
    if old_logp is None:
        old_logp = logp.detach()
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))

    per_token, phi = _surrogate(loss_type, logp, old_logp, ratio, adv, mask, epsilon_low, epsilon_high, delta, gates,
                                is_weights)
    if keep is not None:
        per_token = per_token * keep
    if is_weights is not None and loss_type != "vespo":
        per_token = per_token * is_weights
    per_token_kl = None if ref_logp is None else kl_penalty(logp, ref_logp, kl) * (ratio if bias_correction_kl else 1)
    if per_token_kl is not None and beta != 0.0:
        per_token = per_token + beta * per_token_kl

    loss = aggregate(per_token.expand_as(logp), mask, loss_type, max_completion_length, num_items_in_batch)
    with torch.no_grad():
        clips = _clip_fractions(loss_type, ratio, adv, mask, epsilon_low, epsilon_high)
        return LossOutput(loss, *clips, _masked_mean(ratio, mask),
                          kl_mean=None if per_token_kl is None else _masked_mean(per_token_kl, mask),
                          entropy=None if entropies is None else _masked_mean(entropies, mask),
                          phi_mean=None if phi is None else _masked_mean(phi, mask))


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: ISLevel) -> Tensor:
    """log w per token [B, T], or GSPO's masked mean per sequence [B, 1] (``level="sequence"``)."""
    log_ratio = logp - old_logp
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return log_ratio


def _surrogate(loss_type: str, logp: Tensor, old_logp: Tensor, ratio: Tensor, adv: Tensor, mask: Tensor,
               epsilon_low: float, epsilon_high: float, delta: float | None, gates: SoftGates,
               is_weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The per-token policy term of `policy_loss` ([B, T] or [B, 1]) and VESPO's phi [B, 1]."""
    if loss_type == "cispo":
        return -torch.clamp(ratio, max=epsilon_high).detach() * adv * logp, None
    if loss_type == "sapo":
        pos, neg = adv.new_tensor(gates.sapo_temperature_pos), adv.new_tensor(gates.sapo_temperature_neg)
        tau = torch.where(adv > 0, pos, neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, None
    if loss_type == "vespo":
        phi = vespo_weights(adv, logp - old_logp, mask, is_weights, gates)
        return -phi * adv * logp, phi
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * adv, clipped * adv), None


@torch.no_grad()
def vespo_weights(adv: Tensor, log_ratio: Tensor, mask: Tensor, is_weights: Tensor | None,
                  gates: SoftGates) -> Tensor:
    """VESPO's detached sequence weight phi(W) = exp(lam + k log W - lam W) [B, 1], W = the product of
    the clamped per-token ratios [B, T] over ``mask``, times the product of ``is_weights`` [B, T]
    (logs clamped to [log 1e-8, 20] as the VESPO reference code); k, lam by the sign of A [B, 1]."""
    low = math.log(1e-8)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_weights is not None:
        seq = seq + torch.clamp(torch.log(is_weights), low, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, low, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, adv.new_tensor(gates.vespo_k_pos), adv.new_tensor(gates.vespo_k_neg))
    lam = torch.where(nonneg, adv.new_tensor(gates.vespo_lambda_pos), adv.new_tensor(gates.vespo_lambda_neg))
    lam = lam.clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _clip_fractions(loss_type: str, ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float,
                    epsilon_high: float) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if loss_type == "cispo":
        high = _masked_mean(((ratio > epsilon_high) & (adv > 0)).to(mask.dtype), mask)
        return torch.zeros_like(high), high, high
    if loss_type not in _CLIPPED:
        return None, None, None
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
    return _masked_mean(low, mask), _masked_mean(high, mask), _masked_mean(torch.maximum(low, high), mask)


def _check_options(loss_type: str, beta: float, ref_logp: Tensor | None, max_completion_length: int | None,
                   delta: float | None, epsilon_high: float, level: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (reference-model log-probs)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its fixed normaliser)")
    if delta is not None and delta <= 1.0 + epsilon_high:
        raise ValueError(f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high}")


def aggregate(per_token: Tensor, mask: Tensor, loss_type: LossType, max_completion_length: int | None = None,
              num_items_in_batch: float | Tensor | None = None) -> Tensor:
    """The scalar loss from per-token losses [B, T] and the float mask [B, T]. With S the sum of
    ``per_token * mask``:

        grpo, sapo:          mean over tokens per sequence, then mean over the B sequences;
        bnpo:                S / (number of mask tokens in this batch);
        dr_grpo:             S / (B * max_completion_length)  (``max_completion_length`` required);
        dapo, cispo, vespo:  S / num_items_in_batch  (default: mask tokens in this batch);
        luspo:               sum over tokens per sequence, then mean over B (length-scaled GSPO).

    Token counts are clamped to >= 1 as in TRL; a ``num_items_in_batch`` given is the normaliser
    itself (`rlkit.engine.objective.step_normaliser`), used unclamped."""
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    if num_items_in_batch is None:  # dapo, cispo, vespo
        return masked.sum() / mask.sum().clamp(min=1.0)
    # A normaliser given is used as it is, like TRL's (which clamps the token count to >= 1 before
    # dividing it by ranks x accumulation steps, as `step_normaliser` does): with fewer loss tokens
    # than ranks x steps it is below 1, and a clamp here would shrink such a step's loss.
    return masked.sum() / torch.as_tensor(num_items_in_batch, dtype=per_token.dtype)


# --- normalisers and reward shaping --------------------------------------------------


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
