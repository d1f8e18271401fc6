"""The reward contract: spec, errors, result, and text helpers.

Contract (TRL's, so a reward written for TRL or open-r1 runs unchanged)::

    fn(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]

* ``prompts`` / ``completions``: one entry per sample, exactly as TRL's GRPOTrainer passes
  them: for chat data (a ``prompt`` that is a message list, or ``messages``/sharegpt rows) the
  prompt's message list and ``[{"role": "assistant", "content": text}]``; for plain-text data
  (``prompt`` strings, alpaca rows) the prompt as the model saw it and the text.
* ``completion_ids``: token ids per completion (``list[list[int]]``) or ``None``.
* ``prompt_texts`` (rlkit's addition; passed only to functions that name it or take
  ``**kwargs``): the prompts as the model saw them, rendered with the template, for chat data
  too (e.g. to see that a template opened ``<think>``).
* ``kwargs``: the dataset columns of each sample (as lists, same length) plus the recipe
  spec's ``args``. Only the names the signature accepts are passed (all of them when it has
  ``**kwargs``).
* Returns one float per sample; ``None`` means "not applicable to this sample".
* ``def``, ``async def`` or a generator (what it yields is the list). A class is accepted too:
  the spec's ``args`` go to its constructor, the instance's ``__call__`` follows the contract
  above (columns only), and an optional ``setup()`` runs once before the first call (load a
  model there, not in ``__init__``); a module-level callable instance, a ``functools.partial``
  and a static, class or bound method (``module:Class.method``) work as well (see
  ``rlkit.reward.resolve.resolve``).

Recipe: ``rewards: [{fn: "module.path:function", weight: 1.0, args: {...}}]``; ``fn`` may
also be ``path/to/file.py:function`` relative to the recipe's folder, or TRL's dotted
``module.function``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import RewardError

FIXED_PARAMS = ("prompts", "completions", "completion_ids", "prompt_texts")
_PREVIEW = 200


@dataclass(frozen=True)
class RewardSpec:
    """One entry of the recipe's ``rewards`` list (the recipe's own type for it: `GRPOConfig.rewards`).

    fn: ``package.module:function``, ``path/to/file.py:function`` or ``module.function``.
    weight: multiplier in the weighted sum. args: extra kwargs for every call (for a class:
    constructor kwargs). name: metric name (default: the function/class name).
    timeout_s: wall-clock limit of one call on a batch (None: no limit); a reward that declares
    what a batch takes (`batch_seconds`) is given at least that.
    on_error: ``{"default": x}`` fills x for samples whose call raised or timed out (counted
    in metrics) instead of stopping the run.
    range: ``[low, high]`` the values it may return (either may be null: unbounded); default:
    what the function declares with `reward_range`. A value outside it stops the run with one
    line naming the function and the sample, or, with ``clip``, is clipped and counted.
    fail_fast: a call that raises for one sample stops the run. Without it that sample alone
    scores ``on_error.default``, else the range's low end, else 0 (counted in
    ``reward/<name>/errors``); a call that fails for every sample of a batch still stops it.
    """

    fn: str  # package.module:function, path/to/file.py:function (beside the recipe) or module.function
    weight: float = 1.0  # multiplier in the weighted sum (0: logged only)
    # extra keyword arguments of every call (a class: of its constructor)
    args: dict[str, Any] = field(default_factory=dict)
    name: str | None = None  # metric name (default: the function or class name)
    timeout_s: float | None = 30.0  # limit of a call on a batch (None: none; more if the reward declares more)
    # {default: x}: x for samples whose call raised or timed out, instead of stopping
    on_error: dict[str, float] | None = None
    # [low, high]: the values it may return (null: what the function declares, if anything)
    range: list[float | None] | None = None
    clip: bool = False  # a value outside `range` is clipped and counted, instead of stopping the run
    fail_fast: bool = False  # a call that raises for one sample stops the run (else: that sample scores low)

    def __post_init__(self) -> None:
        fn = self.fn.strip() if isinstance(self.fn, str) else ""
        if not (":" in fn or "." in fn) or fn.startswith((":", ".")) or fn.endswith((":", ".")):
            raise RewardError("expected 'module.path:function', 'path/to/file.py:function' or TRL's "
                              f"'module.function', got {self.fn!r}", key="fn")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise RewardError(f"expected a finite number, got {self.weight!r}", key="weight")
        if not isinstance(self.args, dict):
            raise RewardError(f"expected a mapping, got {type(self.args).__name__}", key="args")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise RewardError(f"expected a positive number or null, got {self.timeout_s!r}", key="timeout_s")
        if self.on_error is not None:
            _check_on_error(self.on_error)
        if self.range is not None:
            check_range(self.range, "range")
        for k in ("clip", "fail_fast"):
            if not isinstance(getattr(self, k), bool):
                raise RewardError(f"expected true or false, got {getattr(self, k)!r}", key=k)


def _check_on_error(on_error: Any) -> None:
    if not isinstance(on_error, dict) or set(on_error) != {"default"}:
        raise RewardError(f"expected {{default: <number>}}, got {on_error!r}", key="on_error")
    d = on_error["default"]
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d):
        raise RewardError(f"expected a finite number, got {d!r}", key="on_error.default")


def check_range(bounds: Any, key: str) -> tuple[float | None, float | None]:
    """``[low, high]`` (either may be None) as a checked tuple; RewardError naming ``key``."""
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2 or any(
            b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b))
            for b in bounds):
        raise RewardError(f"expected [low, high] (numbers or null), got {bounds!r}", key=key)
    low, high = bounds
    if low is not None and high is not None and low > high:
        raise RewardError(f"low {low} is above high {high}", key=key)
    return (None if low is None else float(low), None if high is None else float(high))


def reward_range(low: float | None | Callable[..., tuple], high: float | None = None) -> Callable[[Any], Any]:
    """Declare the values a reward returns (None: unbounded on that side): rlkit checks every
    value it returns against ``[low, high]`` (a recipe's ``range:`` overrides it). ``low`` may be a
    function of the reward's keyword arguments returning ``(low, high)``, for a range set by them."""
    bounds = low if callable(low) else check_range([low, high], "reward_range")

    def mark(fn: Any) -> Any:  # on a class, a function stays one (never bound to its instances)
        fn.rlkit_range = staticmethod(bounds) if isinstance(fn, type) and callable(bounds) else bounds
        return fn
    return mark


def declared_range(fn: Any, args: dict[str, Any]) -> tuple[float | None, float | None] | None:
    """The range ``fn`` declares with `reward_range`, for these arguments (its defaults filled in)."""
    declared = getattr(fn, "rlkit_range", None)
    if not callable(declared):
        return declared
    return check_range(list(declared(**with_defaults(fn, args))), "reward_range")


def with_defaults(fn: Any, args: dict[str, Any]) -> dict[str, Any]:
    """`args` with the defaults of `fn`'s other keyword parameters filled in."""
    import inspect

    try:
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}
    except (TypeError, ValueError):
        defaults = {}
    return {**defaults, **args}


class Failed(float):
    """A sample's score that is a failure the function itself caught (its code ran past its time
    limit, its sandbox was killed): it scores this value and is counted in `reward/<fn>/errors`,
    said once in the log; the step goes on. Compares and computes as the float it holds."""

    def __new__(cls, value: float, why: str = "") -> Failed:
        self = super().__new__(cls, value)
        self.why = why
        return self


def batch_seconds(estimate: Callable[[int, dict[str, Any]], float]) -> Callable[[Any], Any]:
    """Declare what a batch of n samples may take (`estimate(n, args)`, seconds; `args`: the spec's
    args over the function's defaults), for a reward that
    bounds each sample itself (a code sandbox's wall clock): rlkit waits for a batch at least that
    long, whatever the spec's `timeout_s`, so a batch of slow samples costs those samples, never the
    step."""
    def mark(fn: Any) -> Any:
        fn.rlkit_batch_seconds = estimate
        return fn
    return mark


def needs_one_of(*columns: str) -> Callable[[Any], Any]:
    """Mark a reward that reads whichever of these dataset columns a dataset has (its
    parameters default to None): a dataset with none of them is an error before launch."""
    def mark(fn: Any) -> Any:
        fn.rlkit_needs_one_of = columns
        return fn
    return mark


def completion_text(c: Any) -> str:
    """The text of one completion: a string, or the concatenated contents of a message list (the
    model's turns: a multi-turn completion's tool results are not its text)."""
    if isinstance(c, str):
        return c
    if isinstance(c, dict):
        return str(c.get("content") or "")
    if isinstance(c, (list, tuple)):
        return "".join(completion_text(m) for m in c if not (isinstance(m, dict) and m.get("role") == "tool"))
    return "" if c is None else str(c)


def prompt_text(p: Any) -> str:
    """The text of one prompt; for a message list, the messages joined by newlines."""
    if isinstance(p, (list, tuple)):
        return "\n".join(completion_text(m) for m in p)
    return completion_text(p)


def preview(s: str, n: int = _PREVIEW) -> str:
    """``s`` on one line, cut to ``n`` characters."""
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 1] + "…"


def did_you_mean(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class RewardResult:
    """Scores of one batch.

    total: weighted sum per sample over functions that returned non-None.
    per_fn: raw values per function (None = not applicable or failed without default).
    errors: samples whose call raised / timed out and got a default, or that the function scored
    as `Failed`, per function.
    clipped: values clipped into the function's range (its spec's ``clip``), per function.
    seconds: wall time of each function's call(s).
    failures: (sample index, one-line message) per function; filled only in
    ``collect_errors`` mode (the ``rlkit reward test`` tool), otherwise failures raise.
    """

    total: list[float]
    per_fn: dict[str, list[float | None]]
    errors: dict[str, int]
    seconds: dict[str, float]
    failures: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat metrics: ``{prefix}/mean|std`` of the total and
        ``{prefix}/{fn}/mean|std|none|errors|clipped|seconds``.

        Means/stds are over non-None values, std is the population std (ddof=0); NaN when a
        function returned no value.
        """
        out = {f"{prefix}/mean": _mean(self.total), f"{prefix}/std": _std(self.total)}
        for name, vals in self.per_fn.items():
            xs = [v for v in vals if v is not None]
            out[f"{prefix}/{name}/mean"] = _mean(xs)
            out[f"{prefix}/{name}/std"] = _std(xs)
            out[f"{prefix}/{name}/none"] = float(len(vals) - len(xs))
            out[f"{prefix}/{name}/errors"] = float(self.errors.get(name, 0))
            out[f"{prefix}/{name}/clipped"] = float(self.clipped.get(name, 0))
            out[f"{prefix}/{name}/seconds"] = float(self.seconds.get(name, 0.0))
        return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: Sequence[float]) -> float:
    if not xs:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
