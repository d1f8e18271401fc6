"""N-gram repetition penalty (Yeo et al. 2025, appendix C.2; open-r1's and TRL's
``repetition_penalty_reward``), for English, Chinese and mixed text."""

from __future__ import annotations

import re
from typing import Any

from rlkit.reward.contract import completion_text, reward_range

# one unit per CJK character (Chinese and Japanese are written without spaces), else one per word
_UNITS = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"
                    r"|[^\s\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
UNITS = ("auto", "word", "char", "token")


def units(text: str, unit: str) -> list[str]:
    """The sequence n-grams are taken over: ``auto`` each CJK character and each
    whitespace-separated run of other text; ``word`` whitespace-separated words (open-r1's
    English mode); ``char`` every non-space character. Lower-cased."""
    text = text.lower()
    if unit == "auto":
        return _UNITS.findall(text)
    if unit == "word":
        return text.split()
    return [ch for ch in text if not ch.isspace()]


@reward_range(lambda max_penalty=-1.0, **_: (min(max_penalty, 0.0), 0.0))
def repetition_penalty(completions: list, completion_ids: list | None = None, ngram_size: int = 3,
                       max_penalty: float = -1.0, unit: str = "auto", **kwargs: Any) -> list[float]:
    """``(1 - distinct n-grams / n-grams) * max_penalty``: 0.0 for a completion without a
    repeated n-gram, towards ``max_penalty`` (<= 0) for one that repeats itself; 0.0 when it
    has fewer than ``ngram_size`` units.

    unit: ``auto`` (default: words, and single characters for Chinese/Japanese/Korean, so
    "我很好我很好" has repeats while open-r1's English mode would see one word), ``word``,
    ``char``, or ``token`` (the completion's token ids, as TRL does; needs ``completion_ids``).
    """
    if max_penalty > 0:
        raise ValueError(f"max_penalty must be <= 0 (it is a penalty), got {max_penalty}")
    if not (isinstance(ngram_size, int) and ngram_size >= 1):
        raise ValueError(f"ngram_size must be a positive integer, got {ngram_size!r}")
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    if unit == "token" and completion_ids is None:
        raise ValueError("unit 'token' needs completion_ids (token ids of each completion)")
    out = []
    for i, c in enumerate(completions):
        seq = list(completion_ids[i]) if unit == "token" else units(completion_text(c), unit)
        if len(seq) < ngram_size:
            out.append(0.0)
            continue
        grams = [tuple(seq[j:j + ngram_size]) for j in range(len(seq) - ngram_size + 1)]
        out.append((1.0 - len(set(grams)) / len(grams)) * max_penalty + 0.0)  # + 0.0: no -0.0
    return out
