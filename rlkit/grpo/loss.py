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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# The names a recipe may use (`grpo.kl`, `grpo.importance_sampling_level`; `grpo.loss_type`: `LOSSES`).
KL_KINDS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
KLKind = Literal[KL_KINDS]
ISLevel = Literal[IS_LEVELS]


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
    kind = LOSSES[loss_type]
    mask = mask.to(logp.dtype)
    if old_logp is None:
        old_logp = logp.detach()
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))

    per_token, phi = kind.surrogate(Terms(logp, old_logp, ratio, adv, mask, epsilon_low, epsilon_high, delta, gates,
                                          is_weights))
    if keep is not None:
        per_token = per_token * keep
    if is_weights is not None and not kind.weighs_sequences:
        per_token = per_token * is_weights
    per_token_kl = None if ref_logp is None else kl_penalty(logp, ref_logp, kl) * (ratio if bias_correction_kl else 1)
    if per_token_kl is not None and beta != 0.0:
        per_token = per_token + beta * per_token_kl

    loss = kind.aggregation(per_token.expand_as(logp) * mask, mask, max_completion_length, num_items_in_batch)
    with torch.no_grad():
        clips = kind.clipping(ratio, adv, mask, epsilon_low, epsilon_high)
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


@dataclass(frozen=True)
class Terms:
    """What a loss's per-token policy term is computed from (`policy_loss`'s tensors and options)."""

    logp: Tensor
    old_logp: Tensor
    ratio: Tensor
    adv: Tensor
    mask: Tensor
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    gates: SoftGates
    is_weights: Tensor | None


def _ppo_clipped(t: Terms) -> tuple[Tensor, None]:
    """PPO's clipped surrogate, with INTELLECT-2's cap ``delta`` on the unclipped side when set."""
    clipped = torch.clamp(t.ratio, 1 - t.epsilon_low, 1 + t.epsilon_high)
    unclipped = t.ratio if t.delta is None else torch.clamp(t.ratio, max=t.delta)
    return -torch.min(unclipped * t.adv, clipped * t.adv), None


def _cispo(t: Terms) -> tuple[Tensor, None]:
    """MiniMax-M1: the detached weight capped at epsilon_high times A logp."""
    return -torch.clamp(t.ratio, max=t.epsilon_high).detach() * t.adv * t.logp, None


def _sapo(t: Terms) -> tuple[Tensor, None]:
    """A sigmoid gate on the ratio, its temperature by the sign of A."""
    pos, neg = t.adv.new_tensor(t.gates.sapo_temperature_pos), t.adv.new_tensor(t.gates.sapo_temperature_neg)
    tau = torch.where(t.adv > 0, pos, neg)
    return -torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau * t.adv, None


def _vespo(t: Terms) -> tuple[Tensor, Tensor]:
    """VESPO: the detached sequence weight phi(W) times A logp (phi returned for its metric)."""
    phi = vespo_weights(t.adv, t.logp - t.old_logp, t.mask, t.is_weights, t.gates)
    return -phi * t.adv * t.logp, phi


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


Fractions = tuple[Tensor | None, Tensor | None, Tensor | None]


def _ppo_clip_fractions(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float, epsilon_high: float) -> Fractions:
    """(low, high, region) as TRL's ``clip_ratio/{low,high,region}_mean``."""
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
    return _masked_mean(low, mask), _masked_mean(high, mask), _masked_mean(torch.maximum(low, high), mask)


def _cap_fractions(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float, epsilon_high: float) -> Fractions:
    """cispo: the share capped (TRL's ``cispo_clip_ratio``) as high and region; none low."""
    high = _masked_mean(((ratio > epsilon_high) & (adv > 0)).to(mask.dtype), mask)
    return torch.zeros_like(high), high, high


def _no_clipping(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float, epsilon_high: float) -> Fractions:
    """The soft losses (sapo, vespo) clip nothing."""
    return None, None, None


def _check_options(loss_type: str, beta: float, ref_logp: Tensor | None, max_completion_length: int | None,
                   delta: float | None, epsilon_high: float, level: str) -> None:
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (reference-model log-probs)")
    if LOSSES[loss_type].aggregation is _fixed_length and max_completion_length is None:
        raise ValueError(f"loss_type={loss_type!r} needs max_completion_length (its fixed normaliser)")
    if delta is not None and delta <= 1.0 + epsilon_high:
        raise ValueError(f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high}")


def _sequence_mean(masked: Tensor, mask: Tensor, max_len: int | None, items: float | Tensor | None) -> Tensor:
    """The mean over tokens per sequence, then over the B sequences."""
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _batch_tokens(masked: Tensor, mask: Tensor, max_len: int | None, items: float | Tensor | None) -> Tensor:
    """S / the mask tokens of this batch."""
    return masked.sum() / mask.sum().clamp(min=1.0)


def _fixed_length(masked: Tensor, mask: Tensor, max_len: int | None, items: float | Tensor | None) -> Tensor:
    """S / (B * max_completion_length)."""
    return masked.sum() / (masked.shape[0] * max_len)


def _sequence_sum(masked: Tensor, mask: Tensor, max_len: int | None, items: float | Tensor | None) -> Tensor:
    """The sum over tokens per sequence, then the mean over B (length-scaled GSPO)."""
    return masked.sum(-1).mean()


def _items(masked: Tensor, mask: Tensor, max_len: int | None, items: float | Tensor | None) -> Tensor:
    """S / num_items_in_batch (default: the mask tokens of this batch)."""
    if items is None:
        return _batch_tokens(masked, mask, max_len, items)
    # A normaliser given is used as it is, like TRL's (which clamps the token count to >= 1 before
    # dividing it by ranks x accumulation steps, as `step_normaliser` does): with fewer loss tokens
    # than ranks x steps it is below 1, and a clamp here would shrink such a step's loss.
    return masked.sum() / torch.as_tensor(items, dtype=masked.dtype)


@dataclass(frozen=True)
class Loss:
    """One `grpo.loss_type`: its per-token policy term, how the per-token losses become the scalar
    (`aggregate`), the clipping fractions it reports, and what it asks of the recipe."""

    surrogate: Callable[[Terms], tuple[Tensor, Tensor | None]]
    aggregation: Callable[[Tensor, Tensor, int | None, float | Tensor | None], Tensor]
    clipping: Callable[[Tensor, Tensor, Tensor, float, float], Fractions]
    weighs_sequences: bool = False  # folds the rollout correction into its own sequence weight (no sequence-level one)
    caps_ratio: bool = False  # epsilon_high is the weight's cap, not a clip range (> 1)


# Every loss a recipe may name, as TRL 1.16 computes it.
LOSSES: dict[str, Loss] = {
    "grpo": Loss(_ppo_clipped, _sequence_mean, _ppo_clip_fractions),
    "bnpo": Loss(_ppo_clipped, _batch_tokens, _ppo_clip_fractions),
    "dr_grpo": Loss(_ppo_clipped, _fixed_length, _ppo_clip_fractions),
    "dapo": Loss(_ppo_clipped, _items, _ppo_clip_fractions),
    "cispo": Loss(_cispo, _items, _cap_fractions, caps_ratio=True),
    "sapo": Loss(_sapo, _sequence_mean, _no_clipping),
    "luspo": Loss(_ppo_clipped, _sequence_sum, _ppo_clip_fractions),
    "vespo": Loss(_vespo, _items, _no_clipping, weighs_sequences=True),
}
LOSS_TYPES = tuple(LOSSES)
LossType = Literal[LOSS_TYPES]


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
    itself (`rlkit.learner.objective.step_normaliser`), used unclamped."""
    return LOSSES[loss_type].aggregation(per_token * mask, mask, max_completion_length, num_items_in_batch)
