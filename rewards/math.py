"""Math accuracy with ``math-verify``: LaTeX, ``\\boxed{}``, fractions, plain numbers.

The prediction is taken from the last ``<answer>…</answer>`` if there is one, else from
the last ``\\boxed{}``, else from the last ``#### N`` line (GSM8K's ending; ``$``, ``%`` and
thousands commas dropped), else the whole completion as math-verify reads it, else the last number.

A gold that is words, not math (``forty two``, ``Paris``, ``巴黎``: a run of three or more
letters that is not a LaTeX command or a function name such as ``sin``/``log``/``sqrt``, or
any CJK character), is never read as algebra: it would be a product of one-letter symbols,
so anagrams would match. (A unit in ``\\text{}`` after a number stays math.) It is compared
as text instead: the final answer (the last ``<answer>…</answer>`` or ``\\boxed{…}``,
nothing else) must equal it, ignoring case, ``\\text{}``, repeated spaces and punctuation
around it. A missing or empty gold, or one math-verify cannot parse, scores None.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from typing import Any

from rlkit.reward.contract import completion_text, reward_range

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH_ANSWER = re.compile(r"^[ \t]*####[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTERS = re.compile(r"[^\W\d_]+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
               "log", "ln", "lg", "exp", "sqrt", "pi", "inf", "infty", "oo", "lim", "max", "min", "mod", "gcd",
               "lcm", "det", "deg", "dx", "dy", "dz", "dt", "frac", "cdot", "times", "div", "pm", "le", "ge"}


def _timeout(seconds: int) -> int | None:
    """math-verify's timeout uses SIGALRM, which only works on the main thread; elsewhere
    it must be None (the scorer's per-call timeout then bounds the call, so math-verify's
    warning that nothing bounds it is dropped)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


class _BoundedElsewhere(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_BoundedElsewhere())


def _parse(text: str) -> list:
    from math_verify import parse  # deferred: sympy import is ~1 s

    return parse(text, parsing_timeout=_timeout(5))


def is_text_gold(answer: Any) -> bool:
    """Whether a gold answer is words rather than math (see the module doc)."""
    s = unicodedata.normalize("NFKC", str(answer))
    if _CJK.search(s):
        return True
    outside = _LATEX_COMMAND.sub(" ", _TEXT_WRAPPER.sub(" ", s))
    if _words(outside):
        return True
    # words only inside \\text{}: a unit after a number ("5\\text{ cm}") is math, "\\text{Monday}" is not
    return _words(" ".join(_TEXT_WRAPPER.findall(s))) and not re.search(r"\d", outside)


def _words(s: str) -> bool:
    return any(len(w) >= 3 and w.lower() not in _MATH_WORDS for w in _LETTERS.findall(s))


def _plain(text: str) -> str:
    """Text for an exact comparison: NFKC, \\text{} unwrapped, $ dropped, case folded, spaces
    collapsed, punctuation around it stripped."""
    s = unicodedata.normalize("NFKC", text)
    while _TEXT_WRAPPER.search(s):
        s = _TEXT_WRAPPER.sub(r"\1", s)
    s = " ".join(s.replace("$", " ").split()).casefold()
    return s.strip(" .,;:!?。，；：！？\"'`()[]{}")


def final_answer(completion: Any) -> str | None:
    """The text of the last ``<answer>…</answer>``, else of the last ``\\boxed{…}`` (without the
    box), else of the last ``#### …`` line, else None."""
    text = completion_text(completion)
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1]
    boxed = last_boxed(text)
    return boxed[len("\\boxed{"):-1] if boxed else hash_final(text)


def hash_final(text: str) -> str | None:
    """What follows the last ``####`` at a line start (GSM8K's final answer), with ``$``, ``%``
    and thousands commas dropped (``#### $1,200`` -> ``1200``); None when there is none."""
    found = _HASH_ANSWER.findall(text)
    if not found:
        return None
    return _THOUSANDS.sub("", found[-1]).replace("$", "").replace("%", "").strip()


def after_reasoning(completion: Any, delimiters: list[str]) -> str | None:
    """The text after the last of ``delimiters`` (e.g. ``</think>``), or None when none occurs
    (an unfinished reasoning block)."""
    text = completion_text(completion)
    cuts = [text.rfind(d) + len(d) for d in delimiters if d in text]
    return text[max(cuts):] if cuts else None


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
    marked = tagged[-1].strip() if tagged else last_boxed(text) or hash_final(text)
    text = marked or text
    got = _parse(text)
    if not got and marked and "$" not in text:
        got = _parse(f"${text}$")
    if not got:
        nums = _LAST_NUMBER.findall(text)
        if nums:
            got = _parse(nums[-1])
    return got


@reward_range(0.0, 1.0)
def accuracy(completions: list, answer: list, reasoning_delimiters: list[str] | None = None,
             **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equal to ``answer`` (for a
    text gold: the same text, see the module doc), else 0.0; None when the gold is missing or
    cannot be parsed (not applicable).

    reasoning_delimiters: e.g. ``["</think>"]``: only the text after the last delimiter is
    scored, and a completion without one (its reasoning never ended: a truncated rollout)
    scores 0.0, so an answer written only inside the reasoning earns nothing (TRL's
    ``reasoning_accuracy_reward``). None (default): the whole completion.
    """
    from math_verify import verify

    if reasoning_delimiters is not None and (isinstance(reasoning_delimiters, str) or not all(
            isinstance(d, str) and d for d in reasoning_delimiters)):
        raise ValueError(f"reasoning_delimiters must be a list of non-empty strings, got {reasoning_delimiters!r}")
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        if a is None or not str(a).strip():
            out.append(None)
            continue
        if reasoning_delimiters is not None:
            c = after_reasoning(c, reasoning_delimiters)
            if c is None:
                out.append(0.0)
                continue
        if is_text_gold(a):
            got = final_answer(c)
            out.append(float(got is not None and _plain(got) == _plain(str(a))))
            continue
        gold = parse_gold(a)
        if not any(not isinstance(g, str) for g in gold):  # only the raw string: unparseable
            out.append(None)
            continue
        pred = parse_prediction(c)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=_timeout(5))))
    return out


_RESULT = re.compile(r"=\s*[$€£¥]?\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def _values(text: str) -> set:
    """The numbers a worked solution computes: each one right after an ``=`` (a currency sign
    between them allowed), and its final ``#### N``; as exact fractions (``2.50`` == ``2.5``)."""
    from fractions import Fraction

    found = _RESULT.findall(unicodedata.normalize("NFKC", text))
    final = hash_final(text)
    if final and _LAST_NUMBER.fullmatch(final):
        found.append(final)
    out = set()
    for s in found:
        try:
            out.add(Fraction(s.replace(",", "")))
        except (ValueError, ZeroDivisionError):
            continue
    return out


@reward_range(0.0, 1.0)
def solution_values(completions: list, solution: list, **kwargs: Any) -> list[float | None]:
    """Partial credit against a worked reference solution (a ``solution`` column, e.g. GSM8K's):
    the share of the values the reference computes (each number right after an ``=``, and its
    ``#### N``) that the completion computes too (also right after an ``=`` or on its ``####``
    line). A dense signal for a model that seldom reaches the final answer: the right
    intermediate results earn part of the credit, numbers merely copied from the question do not.
    None where the reference computes nothing."""
    out: list[float | None] = []
    for c, ref in zip(completions, solution):
        want = _values(str(ref or ""))
        out.append(None if not want else len(want & _values(completion_text(c))) / len(want))
    return out
