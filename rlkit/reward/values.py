"""What a reward returned, checked: floats or None within the function's range (clipped and counted
with the spec's `clip`), and the one-line messages that name the function and the sample."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

from rlkit.reward.contract import RewardError, completion_text, preview, prompt_text
from rlkit.reward.resolve import ResolvedReward

Batch = tuple[list, list, "list | None", dict]  # prompts, completions, completion ids, columns


class BadValue(RewardError):
    """A returned value of the wrong shape, type or range (not an exception the function raised)."""


def fallback(r: ResolvedReward) -> float:
    """What a sample whose call raised scores: on_error's default, else the range's low end, else 0."""
    if r.spec.on_error is not None:
        return float(r.spec.on_error["default"])
    low = r.bounds[0] if r.bounds else None
    return 0.0 if low is None else low


def validate(r: ResolvedReward, out: Any, n: int, batch: Batch, clipped: dict[str, int]) -> list[float | None]:
    """The call's output as floats/None within the function's range (clipped and counted with the
    spec's `clip`), or RewardError naming the function and the sample."""
    who = f"{r.key} {r.name!r}"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise BadValue(f"{who} returned {type(out).__name__}; expected a list of {n} floats (None = n/a)")
    if len(out) != n:
        raise BadValue(f"{who} returned {len(out)} values for {n} completions")
    low, high = r.bounds or (None, None)
    lo, hi = -math.inf if low is None else low, math.inf if high is None else high
    vals: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(None)
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # numpy / torch scalars
            v = v.item()
        if not isinstance(v, Real):
            raise BadValue(f"{who} returned {type(v).__name__} {preview(repr(v), 40)} at index {i}; "
                              "expected a float or None")
        v = float(v)
        if r.spec.clip and not (math.isnan(v) or lo <= v <= hi):
            v = min(max(v, lo), hi)
            clipped[r.name] = clipped.get(r.name, 0) + 1
        if math.isnan(v) or (math.isinf(v) and lo <= v <= hi):  # no bound on that side to clip to
            raise BadValue(f"{who} returned {v} at index {i} {sample_text(batch, i)}; rewards must be finite")
        if not lo <= v <= hi:
            raise BadValue(f"{who} returned {v:g} at index {i} {sample_text(batch, i)}, outside its range "
                           f"[{bound_text(low)}, {bound_text(high)}]; fix it, or set `clip: true` on this reward "
                           "to clip and count such values")
        vals.append(v)
    return vals


def bound_text(b: float | None) -> str:
    return "-" if b is None else f"{b:g}"


def sample_text(batch: Batch, i: int) -> str:
    return (f"(prompt={preview(prompt_text(batch[0][i]))!r}, "
            f"completion={preview(completion_text(batch[1][i]))!r})")


def failure(r: ResolvedReward, e: BaseException, batch: Batch, i: int | None) -> str:
    what = f"{type(e).__name__}: {preview(str(e), 300)}"
    where = (f"on sample {i} {sample_text(batch, i)}" if i is not None else
             f"on the whole batch of {len(batch[1])} (each sample alone passes)")
    if r.spec.on_error:
        hint = ""
    elif i is not None and r.spec.fail_fast:
        hint = "; fix it, or drop `fail_fast` to score such samples low"
    else:
        hint = "; fix it, or set `on_error: {default: 0.0}` on this reward"
    return f"{r.key} {r.name!r} raised {what} {where}{hint}"
