"""Length rewards: Kimi k1.5 group-relative length penalty, cosine length-scaled accuracy, and
DAPO soft overlong punishment."""

from __future__ import annotations

import json
import math
from typing import Any

from rlkit.reward.contract import completion_text, reward_range


def _length(completions: list, completion_ids: list | None, i: int) -> int:
    return len(completion_ids[i]) if completion_ids is not None else len(completion_text(completions[i]))


def _group_key(p: Any) -> str:
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False, default=str)


@reward_range(-0.5, 0.5)
def length_penalty(prompts: list, completions: list, answer: list, completion_ids: list | None = None,
                   **kwargs: Any) -> list[float | None]:
    """Kimi k1.5 length reward, relative to the other completions of the same prompt.

    With ``lam = 0.5 - (len - min_len) / (max_len - min_len)`` over the group (samples
    sharing a prompt): a correct completion gets ``lam``, an incorrect one ``min(0, lam)``;
    0.0 when all lengths in the group are equal. So within [-0.5, 0.5]: short correct
    answers are rewarded, long wrong ones punished. Length is in tokens
    (``completion_ids``) or, without ids, in characters. Correctness is
    ``rewards.math.accuracy`` against ``answer``; where it cannot judge (no gold, or one it
    cannot parse) this reward is None too (not applicable), as everywhere in rlkit.
    """
    from rewards.math import accuracy

    judged = accuracy(completions, answer)
    lengths = [_length(completions, completion_ids, i) for i in range(len(completions))]
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(_group_key(p), []).append(i)
    out: list[float | None] = [None if j is None else 0.0 for j in judged]
    for idx in groups.values():
        lo, hi = min(lengths[i] for i in idx), max(lengths[i] for i in idx)
        if hi == lo:
            continue
        for i in idx:
            if judged[i] is not None:
                lam = 0.5 - (lengths[i] - lo) / (hi - lo)
                out[i] = lam if judged[i] else min(0.0, lam)
    return out


@reward_range(lambda min_value_wrong, max_value_wrong, min_value_correct, max_value_correct, **_: (
    min(min_value_wrong, max_value_wrong, min_value_correct, max_value_correct),
    max(min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)))
def cosine_scaled(completions: list, answer: list, completion_ids: list | None = None, max_len: int = 1000,
                  min_value_wrong: float = -1.0, max_value_wrong: float = -0.5, min_value_correct: float = 0.5,
                  max_value_correct: float = 1.0, reasoning_delimiters: list[str] | None = None,
                  **kwargs: Any) -> list[float | None]:
    """Accuracy scaled by length on a cosine schedule (Yeo et al. 2025, "Demystifying Long
    Chain-of-Thought Reasoning", appendix C.1; open-r1's and TRL's ``cosine_scaled_reward``).

    With ``p = min(1, len / max_len)`` and ``c = cos(p * pi)``: a correct completion gets
    ``min_value_correct + (max_value_correct - min_value_correct) * (1 + c) / 2`` (from 1.0
    when short down to 0.5 at max_len), a wrong one ``max_value_wrong + (min_value_wrong -
    max_value_wrong) * (1 + c) / 2`` (from -1.0 when short up to -0.5: a long wrong attempt is
    punished less). Length is in tokens (``completion_ids``), else characters; past max_len it
    stays at the long end (TRL clamps, open-r1 does not). Correctness is
    ``rewards.math.accuracy`` (``reasoning_delimiters`` goes to it); None where it cannot judge.
    """
    from rewards.math import accuracy

    if not (isinstance(max_len, int) and max_len > 0):
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    judged = accuracy(completions, answer, reasoning_delimiters=reasoning_delimiters)
    out: list[float | None] = []
    for i, correct in enumerate(judged):
        if correct is None:
            out.append(None)
            continue
        cosine = math.cos(min(1.0, _length(completions, completion_ids, i) / max_len) * math.pi)
        lo, hi = (min_value_correct, max_value_correct) if correct else (max_value_wrong, min_value_wrong)
        out.append(lo + 0.5 * (hi - lo) * (1.0 + cosine))
    return out


@reward_range(lambda penalty=1.0, **_: (min(-penalty, 0.0), max(-penalty, 0.0)))
def soft_overlong(completions: list, completion_ids: list | None, max_len: int, buffer_len: int,
                  penalty: float = 1.0, **kwargs: Any) -> list[float]:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), in tokens.

    ``L = len(completion_ids[i])``, ``start = max_len - buffer_len``:
    0 for ``L <= start``; ``-penalty * (L - start) / buffer_len`` for ``start < L <= max_len``
    (linear from 0 to -penalty); ``-penalty`` beyond ``max_len``. ``max_len`` is the
    generation limit; add this to the task reward (it is a penalty, never positive).
    """
    if completion_ids is None:
        raise ValueError("soft_overlong needs completion_ids (token ids of each completion)")
    if not (0 < buffer_len <= max_len):
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    start = max_len - buffer_len
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= start:
            out.append(0.0)
        elif n <= max_len:
            out.append(-penalty * (n - start) / buffer_len)
        else:
            out.append(-float(penalty))
    return out
