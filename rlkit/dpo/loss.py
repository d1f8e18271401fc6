"""The preference losses on sequence log-probabilities (torch only), under TRL 1.16's names and
with its arithmetic: DPO's loss family (`dpo_loss`), KTO on unpaired rows (`kto_loss`), ORPO
(`orpo_loss`) and CPO / SimPO (`cpo_loss`), which need no reference model, and the Bradley-Terry reward-model loss
(`reward_loss`). Each takes the tensors a forward produced and returns the loss and TRL's metrics
under TRL's keys; the stage's objectives (`objective.py`) form those tensors from a model.

DPO's inputs follow TRL's batch: the chosen rows first, then the rejected ones, so a per-token
tensor is [2B, L-1] (shifted: position t scores token t+1) and `completion_mask` is [2B, L]
(unshifted, 1 on the completion's tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# the losses built on the chosen-rejected score difference: the only ones f-DPO generalises
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})


@dataclass(frozen=True)
class DPOTerms:
    """What `dpo_loss` reads of a loss configuration (`rlkit.dpo.config.DPOLossConfig` has these
    fields, TRL's `DPOConfig` names)."""

    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float = 0.05


def sequence_logps(per_token: Tensor, completion_mask: Tensor, ld_alpha: float | None) -> Tensor:
    """[2B] summed completion logprobs of [2B, L-1] per-token ones (0 off the completion). With
    `ld_alpha` (LD-DPO) the tokens past the shorter side's length of each pair count `ld_alpha` times."""
    if ld_alpha is None:
        return per_token.sum(dim=1)
    shifted = completion_mask[:, 1:]
    position = shifted.cumsum(dim=1)  # 1, 2, ... along each completion
    chosen, rejected = shifted.sum(dim=1).long().chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    inside = (position > 0) & (position <= shared)
    return (per_token * inside).sum(dim=1) + ld_alpha * (per_token * (position > shared)).sum(dim=1)


def _scores(logratios: Tensor, terms: DPOTerms) -> Tensor:
    """f'(pi / ref) of a log-ratio: f-DPO's generalisation of the log-ratio (reverse KL: itself)."""
    kind = terms.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind != "alpha_divergence":
        raise ValueError(f"unknown f_divergence_type {kind!r}")
    alpha = terms.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is the reverse KL
        return logratios
    t = (alpha - 1.0) * logratios
    clamp = {torch.float16: 11.0}.get(t.dtype, 80.0)  # exp stays finite in the log-ratio's dtype
    return (torch.exp(torch.clamp(t.float(), max=clamp)) - 1.0).to(t.dtype) / (alpha - 1.0)


@dataclass(frozen=True)
class _Pairs:
    """One batch's pair quantities, each [B]: the sides' log-ratios to the reference, their
    f-scores, completion lengths, sequence logprobs and the reference's; the chosen side's NLL."""

    cr: Tensor
    rr: Tensor
    chosen_scores: Tensor
    rejected_scores: Tensor
    lengths: tuple[Tensor, Tensor]
    logps: tuple[Tensor, Tensor]
    refs: tuple[Tensor, Tensor]
    sft_nll: Tensor

    @property
    def delta(self) -> Tensor:
        return self.chosen_scores - self.rejected_scores

    def per_token_delta(self) -> Tensor:
        return self.chosen_scores / self.lengths[0].clamp(min=1.0) - self.rejected_scores / self.lengths[1].clamp(
            min=1.0)


def _smoothed(beta: float, eps: float, d: Tensor) -> Tensor:
    return -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps


def _exo(beta: float, eps: float, d: Tensor) -> Tensor:
    eps_t = torch.tensor(eps, device=d.device)
    return (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - torch.log1p(-eps_t))
            + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - torch.log(eps_t)))


def _discopop(beta: float, tau: float, d: Tensor) -> Tensor:
    mix = torch.sigmoid(beta * d / tau)
    return -F.logsigmoid(beta * d) * (1 - mix) + torch.exp(-beta * d) * mix


def _sorted(x: Tensor) -> Tensor:
    return torch.sort(x, dim=0)[0]


# each loss_type's per-pair loss [B], from the configuration `t` and the batch's pairs `p`
PAIR_LOSSES: dict[str, Any] = {
    "sigmoid": lambda t, p: -F.logsigmoid(t.beta * p.delta),
    "hinge": lambda t, p: torch.relu(1 - t.beta * p.delta),
    "ipo": lambda t, p: (p.per_token_delta() - 1 / (2 * t.beta)) ** 2,  # the score per completion token
    "exo_pair": lambda t, p: _exo(t.beta, t.label_smoothing, p.delta),
    "nca_pair": lambda t, p: (-F.logsigmoid(t.beta * p.cr) - 0.5 * F.logsigmoid(-t.beta * p.cr)
                              - 0.5 * F.logsigmoid(-t.beta * p.rr)),
    "robust": lambda t, p: (-(1 - t.label_smoothing) * F.logsigmoid(t.beta * p.delta)
                            + t.label_smoothing * F.logsigmoid(-t.beta * p.delta)) / (1 - 2 * t.label_smoothing),
    "bco_pair": lambda t, p: -F.logsigmoid(t.beta * p.cr) - F.logsigmoid(-t.beta * p.rr),
    "sppo_hard": lambda t, p: (p.cr - 0.5 / t.beta) ** 2 + (p.rr + 0.5 / t.beta) ** 2,
    # optimal transport: the sorted margins (aot) or log-ratios (aot_unpaired) matched in order
    "aot": lambda t, p: _smoothed(t.beta, t.label_smoothing, _sorted(p.logps[0] - p.logps[1])
                                  - _sorted(p.refs[0] - p.refs[1])),
    "aot_unpaired": lambda t, p: _smoothed(t.beta, t.label_smoothing, _sorted(p.cr) - _sorted(p.rr)),
    "apo_zero": lambda t, p: 1 - torch.sigmoid(t.beta * p.cr) + torch.sigmoid(t.beta * p.rr),
    "apo_down": lambda t, p: torch.sigmoid(t.beta * p.cr) + 1 - torch.sigmoid(t.beta * (p.cr - p.rr)),
    "discopop": lambda t, p: _discopop(t.beta, t.discopop_tau, p.delta),
    "sft": lambda t, p: p.sft_nll.expand(p.cr.shape[0]),
    "sigmoid_norm": lambda t, p: -F.logsigmoid(t.beta * p.per_token_delta()),
}
DPO_LOSSES = tuple(PAIR_LOSSES)  # TRL's loss_type names, in its order


def dpo_loss(terms: DPOTerms, per_token: Tensor, completion_mask: Tensor, ref_logps: Tensor,
             log_sum_sq_probs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO's loss (TRL's `DPOTrainer`): `per_token` [2B, L-1] policy logprobs (0 off the completion),
    `completion_mask` [2B, L], `ref_logps` [2B] the reference's sequence logprobs (`sequence_logps`
    with the same `ld_alpha`), `log_sum_sq_probs` [2B, L-1] log sum_v p_v^2 per position (WPO's
    `use_weighting` only). The weighted sum of each `loss_type`'s mean over the pairs, and the
    metrics `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
    `logps/chosen`, `logps/rejected` (means over the pairs, detached)."""
    logps = sequence_logps(per_token, completion_mask, terms.ld_alpha).chunk(2)
    refs = ref_logps.chunk(2)
    cr, rr = logps[0] - refs[0], logps[1] - refs[1]
    shifted = completion_mask[:, 1:]
    pairs = _Pairs(cr, rr, _scores(cr, terms), _scores(rr, terms), completion_mask.sum(dim=1).chunk(2), logps, refs,
                   -per_token.chunk(2)[0][shifted.chunk(2)[0].bool()].mean())
    weights = 1.0
    if terms.use_weighting:  # WPO: each pair weighted by both sides' mean aligned probability
        with torch.no_grad():
            aligned = ((per_token - log_sum_sq_probs) * shifted).sum(dim=1) / shifted.sum(dim=1).clamp_min(1)
        chosen_w, rejected_w = torch.exp(aligned).chunk(2)
        weights = chosen_w * rejected_w
    loss = per_token.new_zeros(())
    for kind, weight in zip(terms.loss_type, terms.loss_weights or [1.0] * len(terms.loss_type), strict=True):
        if kind not in PAIR_LOSSES:
            raise ValueError(f"unknown loss_type {kind!r}; expected one of {', '.join(DPO_LOSSES)}")
        loss = loss + (PAIR_LOSSES[kind](terms, pairs) * weights).mean() * weight
    return loss, {**_side_metrics(terms.beta, cr, rr), "logps/chosen": logps[0].detach().mean(),
                  "logps/rejected": logps[1].detach().mean()}


def kto_loss(loss_type: str, beta: float, logps: Tensor, ref_logps: Tensor, label: Tensor, kl: Tensor,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO's loss (TRL's `KTOTrainer`) over unpaired rows: `logps`, `ref_logps` [N] sequence
    logprobs, `label` [N] bool (desirable), `kl` the batch's KL estimate (from mismatched
    prompt-completion pairs, clamped at 0, detached; 0 for `apo_zero_unpaired`). The mean over the
    rows of the weighted per-row losses (desirable first), and the sums TRL's metrics are made of:
    `rewards/chosen_sum`, `rewards/rejected_sum`, `logps/chosen_sum`, `logps/rejected_sum`, `count/chosen`,
    `count/rejected`, `kl`."""
    if loss_type not in ("kto", "apo_zero_unpaired"):
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected kto or apo_zero_unpaired")
    ratios = logps - ref_logps
    good, bad = ratios[label], ratios[~label]
    if loss_type == "kto":
        chosen, rejected = 1 - torch.sigmoid(beta * (good - kl)), 1 - torch.sigmoid(beta * (kl - bad))
    else:
        chosen, rejected = 1 - torch.sigmoid(beta * good), torch.sigmoid(beta * bad)
    losses = torch.cat((desirable_weight * chosen, undesirable_weight * rejected))
    loss = losses.mean() if losses.numel() else logps.sum() * 0  # a batch of nothing: a zero that backpropagates
    return loss, {"rewards/chosen_sum": beta * good.detach().sum(), "rewards/rejected_sum": beta * bad.detach().sum(),
                  "logps/chosen_sum": logps[label].detach().sum(), "logps/rejected_sum": logps[~label].detach().sum(),
                  "count/chosen": label.sum(), "count/rejected": (~label).sum(), "kl": kl.detach()}


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _side_metrics(beta: float, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    return {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean()}


def orpo_loss(chosen: Tensor, rejected: Tensor, chosen_nll: Tensor, beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (TRL's experimental `ORPOTrainer`, no reference model): `chosen`, `rejected` [B] the
    sides' mean per-token logprobs, `chosen_nll` the chosen side's token-mean NLL; the NLL minus
    beta times the mean log sigmoid of the log odds ratio, with TRL's metrics (rewards from the
    mean logprobs, `log_odds_ratio`, `log_odds_chosen`, `nll_loss`)."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - (beta * ratio).mean()
    return loss, {**_side_metrics(beta, chosen, rejected), "log_odds_ratio": ratio.detach().mean(),
                  "log_odds_chosen": log_odds.detach().mean(), "nll_loss": chosen_nll.detach()}


CPO_LOSSES = ("sigmoid", "hinge", "ipo", "simpo")
# `rlkit dpo`'s reference-free loss types: ORPO, and CPO's sigmoid and simpo losses (what
# LLaMA-Factory's pref_loss orpo / simpo train); the value says whether a side's logprob is its
# token mean (else its sum), as TRL's trainers score them
REFERENCE_FREE = {"orpo": True, "simpo": True, "cpo": False}


def cpo_loss(loss_type: str, chosen: Tensor, rejected: Tensor, chosen_nll: Tensor, beta: float,
             cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, label_smoothing: float = 0.0,
             alpha: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """CPO and SimPO (TRL's experimental `CPOTrainer`, no reference model): `chosen`, `rejected` [B]
    the sides' logprobs (token means for `ipo` and `simpo`, sums otherwise), `chosen_nll` the chosen
    side's token-mean NLL, added `cpo_alpha` times (SimPO proper: `cpo_alpha` 0). `alpha` != 0 is
    AlphaPO's reward (1 - p^-alpha) / alpha in place of the logprob."""
    if loss_type not in CPO_LOSSES:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}; expected one of {', '.join(CPO_LOSSES)}")
    if alpha != 0.0:
        chosen, rejected = (1 - torch.exp(chosen).pow(-alpha)) / alpha, (1 - torch.exp(rejected).pow(-alpha)) / alpha
    logits = chosen - rejected - (simpo_gamma / beta if loss_type == "simpo" else 0.0)
    if loss_type == "hinge":
        pair = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        pair = (logits - 1 / (2 * beta)) ** 2
    else:
        pair = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    loss = pair.mean() + cpo_alpha * chosen_nll
    return loss, {**_side_metrics(beta, chosen, rejected), "nll_loss": chosen_nll.detach()}


def reward_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> tuple[Tensor, dict[str, Any]]:
    """The Bradley-Terry loss of a reward model (TRL's `RewardTrainer`): -log sigmoid(r_chosen -
    r_rejected - margin), plus `center_rewards_coefficient` times the mean squared sum of the two
    rewards; metrics `accuracy` and `margin` (means over the pairs)."""
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss, {"accuracy": (chosen > rejected).float().mean().detach(),
                  "margin": (chosen - rejected).mean().detach()}
