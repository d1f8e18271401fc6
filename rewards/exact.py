"""Exact-answer rewards: normalised string match and first-number match against ``answer``.

Both return 1.0 / 0.0 per sample, and None where the sample has no answer.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Any

from rlkit.reward.contract import completion_text, reward_range

_TRAILING = ".。!！?？;；,，、 \t\n"
# A number: optional sign, digits with optional thousands commas, decimals, or a fraction a/b.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def normalize_text(text: str) -> str:
    """NFKC (full-width → half-width digits, letters, punctuation), casefold, collapse
    whitespace, strip surrounding whitespace and trailing punctuation (``.`` / ``。`` ...)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = " ".join(text.split())
    return text.rstrip(_TRAILING).strip()


def _answers(a: Any) -> list[str] | None:
    if a is None:
        return None
    if isinstance(a, (list, tuple)):
        return [str(x) for x in a] or None
    return [str(a)]


@reward_range(0.0, 1.0)
def exact_match(completions: list, answer: list, normalize: bool = True, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion equals the answer (or one of a list of answers).

    normalize: compare ``normalize_text`` of both; False compares the
    raw strings after stripping surrounding whitespace.
    """
    norm = normalize_text if normalize else str.strip
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        golds = _answers(a)
        if golds is None:
            out.append(None)
            continue
        text = norm(completion_text(c))
        out.append(float(any(text == norm(g) for g in golds)))
    return out


def parse_number(text: str, position: str = "first") -> Fraction | None:
    """The first (or last) number in ``text`` as an exact Fraction; None if there is none.

    Understands ``-3``, ``１２`` (full-width), ``1,000``, ``2.50``, ``3/4`` and ``−3``.
    """
    text = unicodedata.normalize("NFKC", text)
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = (found[0] if position == "first" else found[-1]).replace(",", "").replace("−", "-")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _score_numbers(completions: list, answer: list, position: str,
                   score: Any) -> list[float | None]:
    """`score(got, gold)` per sample on the completion's first/last number (got may be None);
    None where the answer holds no number."""
    if position not in ("first", "last"):
        raise ValueError(f"position must be 'first' or 'last', got {position!r}")
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        gold = None if a is None else parse_number(str(a))
        out.append(None if gold is None else score(parse_number(completion_text(c), position), gold))
    return out


@reward_range(0.0, 1.0)
def number_match(completions: list, answer: list, position: str = "first", **kwargs: Any) -> list[float | None]:
    """1.0 when the first (``position="last"``: last) number in the completion equals the
    number in ``answer``. E.g. prompt ``12+7=``, completion ``19 because...`` → 1.0 for
    answer 19. None when the answer holds no number."""
    return _score_numbers(completions, answer, position, lambda got, gold: float(got is not None and got == gold))


@reward_range(0.0, 1.0)
def number_close(completions: list, answer: list, position: str = "first", **kwargs: Any) -> list[float | None]:
    """Partial credit by relative error: ``max(0, 1 - |got - gold| / max(|gold|, 1))`` for the
    first (or last) number in the completion; 0.0 when it has none; None when ``answer`` holds
    no number. E.g. gold 20: 20 → 1.0, 15 → 0.75, 40 → 0.0. A dense signal for small models
    that cannot yet hit the exact answer (the tiny GRPO recipe pairs it with number_match)."""
    def score(got: Fraction | None, gold: Fraction) -> float:
        return 0.0 if got is None else max(0.0, 1.0 - float(abs(got - gold)) / max(abs(float(gold)), 1.0))

    return _score_numbers(completions, answer, position, score)
