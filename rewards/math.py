"""Math accuracy with ``math-verify``: LaTeX, ``\\boxed{}``, fractions, plain numbers.

The prediction is taken from the last ``<answer>…</answer>`` if there is one, else from
the last ``\\boxed{}``, else the whole completion as math-verify reads it, else the last number.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from typing import Any

from rlkit.reward.contract import completion_text

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _timeout(seconds: int) -> int | None:
    """math-verify's timeout uses SIGALRM, which only works on the main thread; elsewhere
    it must be None (the scorer's per-call timeout then bounds the call)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list:
    from math_verify import parse  # deferred: sympy import is ~1 s

    return parse(text, parsing_timeout=_timeout(5))


def parse_gold(answer: Any) -> list:
    """The gold answer as math-verify expressions ([] when unparseable)."""
    s = unicodedata.normalize("NFKC", str(answer)).strip()
    if "$" in s or "\\boxed" in s:
        return _parse(s)
    return _parse(f"${s}$") or _parse(s)  # a bare gold is read as LaTeX first ("x^2 + 1")


def last_boxed(text: str) -> str | None:
    """``\\boxed{...}`` (balanced braces) of the last ``\\boxed`` in ``text``, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for j in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    return None


def parse_prediction(completion: Any) -> list:
    """The model's final answer as math-verify expressions ([] when none is found)."""
    text = unicodedata.normalize("NFKC", completion_text(completion))
    tagged = _ANSWER.findall(text)
    if tagged:
        text = tagged[-1].strip()
    else:
        text = last_boxed(text) or text
    got = _parse(text)
    if not got and tagged and "$" not in text:
        got = _parse(f"${text}$")
    if not got:
        nums = _LAST_NUMBER.findall(text)
        if nums:
            got = _parse(nums[-1])
    return got


def accuracy(completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equal to ``answer``, else
    0.0; None when the gold answer cannot be parsed (not applicable)."""
    from math_verify import verify

    out: list[float | None] = []
    for c, a in zip(completions, answer):
        gold = parse_gold(a) if a is not None else []
        if not any(not isinstance(g, str) for g in gold):  # only the raw string: unparseable
            out.append(None)
            continue
        pred = parse_prediction(c)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=_timeout(5))))
    return out
