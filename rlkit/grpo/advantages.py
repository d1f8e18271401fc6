"""Group-relative advantages for GRPO (pure tensor math, torch only).

Layout: ``rewards`` is a flat float tensor of N = num_groups * G completions where the G
completions of one prompt are contiguous (``rewards.view(num_groups, G)``), as produced by
repeating each prompt G times.

Conventions (chosen to equal TRL 1.16, ``trl/trainer/grpo_trainer.py``,
``_generate_and_score_completions``, ``multi_objective_aggregation="sum_then_normalize"``):

* std is the *sample* std (Bessel's correction, divide by n - 1): TRL uses
  ``trl.trainer.utils.nanstd``, which multiplies the variance by ``count / (count - 1)``.
  ``std="population"`` (divide by n) is available for codebases that use ``torch.std(unbiased=False)``.
* eps = 1e-4 is *added to the std* (not under the sqrt): TRL's
  ``advantages / (std_rewards + 1e-4)``. With eps = 1e-4, a zero-std group gives 0 / 1e-4 = 0.
* ``"batch"`` scaling centres on the group mean and divides by the std of the whole batch
  (TRL ``scale_rewards="batch"``); ``"none"`` only centres (Dr. GRPO, TRL ``scale_rewards="none"``).
* A recipe picks a registered estimator by name (``grpo.advantage``): ``grpo``, ``no_std`` (= ``dr_grpo``),
  ``batch_std``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``; the registry is the list of
  accepted names. Several reward functions are summed (weighted) before the estimator, or, with
  ``grpo.multi_objective_aggregation: normalize_then_sum``, normalised one by one first
  (:func:`normalize_then_sum`, GDPO).
* NaN rewards mean "unscorable": they are excluded from the group mean/std (nan-aware, as in TRL)
  and get advantage 0.
* A group of size 1 (or a batch of one element for ``"batch"``) has std 0, as in TRL.

The advantages are not detached specially: rewards carry no gradient in practice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import Tensor

Scale = Literal["group", "none", "batch"]
StdKind = Literal["sample", "population"]

DEFAULT_EPS = 1e-4  # TRL 1.16: `advantages / (std_rewards + 1e-4)`
_SCALES = ("group", "none", "batch")
_STDS = ("sample", "population")


def _check_layout(rewards: Tensor, group_size: int) -> int:
    """Validate a flat reward vector in groups of ``group_size``; return the number of groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(
            f"number of rewards N={n} is not divisible by group_size G={group_size}; "
            "rewards must hold whole groups of G completions per prompt"
        )
    return n // group_size


def _nanstd(x: Tensor, dim: int | None, std: StdKind) -> Tensor:
    """Nan-aware std over ``dim`` (all elements if None). Fewer than 2 valid values -> 0."""
    if std not in _STDS:
        raise ValueError(f"std must be one of {_STDS}, got {std!r}")
    if dim is None:
        x = x.reshape(-1)
        dim = 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim)
    sq = torch.nansum((x - mean) ** 2, dim=dim)
    denom = count - 1 if std == "sample" else count
    var = sq / denom.clamp(min=1).to(sq.dtype)
    return torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: Scale = "group",
    eps: float = DEFAULT_EPS,
    std: StdKind = "sample",
) -> Tensor:
    """Group-relative advantages.

    Args:
        rewards: float [N], N = num_groups * group_size, groups contiguous. NaN = unscorable.
        group_size: G, completions per prompt.
        scale: ``"group"`` -> (r - mean_g) / (std_g + eps) (GRPO);
            ``"none"`` -> r - mean_g (Dr. GRPO);
            ``"batch"`` -> (r - mean_g) / (std_batch + eps).
        eps: added to the std (not the variance). Default 1e-4 as in TRL.
        std: ``"sample"`` (n - 1, TRL default) or ``"population"`` (n).

    Returns:
        float [N] advantages, same dtype/device as ``rewards``; 0 where the reward is NaN.
    """
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    num_groups = _check_layout(rewards, group_size)
    grouped = rewards.view(num_groups, group_size)
    mean_g = torch.nanmean(grouped, dim=1, keepdim=True)
    adv = grouped - mean_g
    if scale == "group":
        adv = adv / (_nanstd(grouped, dim=1, std=std).unsqueeze(1) + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(rewards, dim=None, std=std) + eps)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def zero_std_mask(rewards: Tensor, group_size: int, atol: float = 0.0) -> Tensor:
    """Bool [num_groups]: True where every (non-NaN) reward of the group is equal within ``atol``.

    Such groups have zero advantage and carry no policy-gradient signal. (TRL logs the same
    quantity as ``frac_reward_zero_std`` via ``isclose(std, 0)``.)
    """
    num_groups = _check_layout(rewards, group_size)
    grouped = rewards.view(num_groups, group_size)
    valid = ~torch.isnan(grouped)
    hi = torch.where(valid, grouped, torch.full_like(grouped, -float("inf"))).amax(dim=1)
    lo = torch.where(valid, grouped, torch.full_like(grouped, float("inf"))).amin(dim=1)
    spread = torch.where(valid.any(dim=1), hi - lo, torch.zeros_like(hi))
    return spread <= atol


def frac_zero_std(rewards: Tensor, group_size: int, atol: float = 0.0) -> float:
    """Fraction of groups (0..1) whose rewards are all equal; see :func:`zero_std_mask`."""
    return zero_std_mask(rewards, group_size, atol).float().mean().item()


# --- registry -------------------------------------------------------------------------


class AdvantageFn(Protocol):
    def __call__(
        self, rewards: Tensor, group_size: int, *, eps: float = ..., std: StdKind = ...
    ) -> Tensor: ...


ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding an estimator ``f(rewards, group_size, *, eps, std) -> [N]`` to ADVANTAGES.

    Raises ValueError if ``name`` is already registered.
    """

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(
                f"advantage estimator {name!r} is already registered "
                f"(by {getattr(ADVANTAGES[name], '__qualname__', ADVANTAGES[name])}); pick another name"
            )
        ADVANTAGES[name] = fn
        return fn

    return deco


def get_advantage(name: str) -> AdvantageFn:
    """Look up a registered estimator; unknown names raise ValueError listing the valid ones."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGES)}") from None


@register_advantage("grpo")
def grpo_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """(r - mean_g) / (std_g + eps). TRL ``scale_rewards="group"``."""
    return group_advantages(rewards, group_size, "group", eps, std)


@register_advantage("no_std")
@register_advantage("dr_grpo")
def no_std_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """r - mean_g (eps/std unused): Dr. GRPO's advantage (pair it with ``loss_type: dr_grpo`` for
    Dr. GRPO). TRL ``scale_rewards="none"``."""
    return group_advantages(rewards, group_size, "none", eps, std)


@register_advantage("batch_std")
def batch_std_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """(r - mean_g) / (std_batch + eps). TRL ``scale_rewards="batch"``."""
    return group_advantages(rewards, group_size, "batch", eps, std)


@register_advantage("rloo")
def rloo_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j over the group's n valid (non-NaN) rewards,
    = n / (n - 1) * (r_i - mean_g); 0 for a group with fewer than two valid rewards (eps/std
    unused). RLOO (Ahmadian et al. 2024; TRL's RLOOTrainer)."""
    num_groups = _check_layout(rewards, group_size)
    grouped = rewards.view(num_groups, group_size)
    n = (~torch.isnan(grouped)).sum(dim=1, keepdim=True).to(rewards.dtype)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (n - 1).clamp(min=1.0)
    adv = torch.where(n > 1, grouped - others, torch.zeros_like(grouped))
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def _whiten(x: Tensor, eps: float, std: StdKind) -> Tensor:
    """(x - mean) / (std + eps) over all valid (non-NaN) elements of a flat tensor; NaN -> 0."""
    return torch.nan_to_num((x - torch.nanmean(x)) / (_nanstd(x, dim=None, std=std) + eps), nan=0.0)


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """REINFORCE++ (Hu 2025) for an outcome reward: the batch-whitened reward
    (r - mean_batch) / (std_batch + eps), no group baseline."""
    _check_layout(rewards, group_size)
    return _whiten(rewards, eps, std)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: Tensor, group_size: int, *, eps: float = DEFAULT_EPS, std: StdKind = "sample"
) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch:
    (c - mean_batch(c)) / (std_batch(c) + eps) with c = r - mean_g."""
    num_groups = _check_layout(rewards, group_size)
    grouped = rewards.view(num_groups, group_size)
    centred = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
    return _whiten(centred, eps, std)


def normalize_then_sum(per_fn: Tensor, weights: Tensor, group_size: int, eps: float = DEFAULT_EPS,
                       std: StdKind = "sample") -> Tensor:
    """GDPO multi-reward advantages (TRL 1.16 ``multi_objective_aggregation="normalize_then_sum"``).

    per_fn: float [N, K], one column per reward function (NaN where it gave None), groups of
    ``group_size`` contiguous; weights: [K]. Each column is normalised within each group,
    (r - mean_g) / (std_g + eps); the columns are summed with ``weights`` (NaN as 0); the sum is
    whitened over the batch, (s - mean) / (std + eps). Rows where every function gave None -> 0.
    Returns float [N].
    """
    if per_fn.dim() != 2 or weights.shape != per_fn.shape[1:]:
        raise ValueError(f"per_fn must be [N, K] with weights [K], got {tuple(per_fn.shape)} and "
                         f"{tuple(weights.shape)}")
    num_groups = _check_layout(per_fn[:, 0], group_size)
    grouped = per_fn.view(num_groups, group_size, -1)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    spread = _nanstd(grouped, dim=1, std=std).unsqueeze(1) if group_size > 1 else torch.zeros_like(mean)
    normed = ((grouped - mean) / (spread + eps)).view(-1, per_fn.shape[1])
    summed = (normed * weights.to(per_fn.dtype)).nansum(dim=1)
    summed[torch.isnan(per_fn).all(dim=1)] = float("nan")
    return _whiten(summed, eps, std)


# --- reward shaping before the advantages --------------------------------------------


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
