"""Format rewards for R1-style ``<think>…</think><answer>…</answer>`` completions, and for
GSM8K's ``#### N`` final-answer line.

When a prompt ends with ``<think>`` (e.g. the DeepSeek-R1-Distill chat template opens the
think block in the generation prompt), the completion is scored as if it started with it.
For chat data the rewards read the rendered prompt text (``prompt_texts``), since the message
list does not show what the template added.
"""

from __future__ import annotations

import re
from typing import Any

from rlkit.reward.contract import completion_text, prompt_text, reward_range

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_STRUCTURE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_HASH_LINE = re.compile(r"####[ \t]*-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?")
_STEP = re.compile(
    r"(?:Step\s*\d+\s*[:.]"            # Step 1:  / Step 2.
    r"|^\s*\d+[.)]\s"                  # 1. / 2)  at a line start
    r"|^\s*[-*•]\s"                    # bullets
    r"|\b(?:First|Second|Third|Next|Then|Finally),"
    r"|第[一二三四五六七八九十\d]+步|步骤\s*\d+"
    r"|首先|其次|然后|接着|最后)",
    re.MULTILINE,
)


def _texts(prompts: list | None, completions: list, prompt_texts: list | None = None) -> list[str]:
    prompts = prompt_texts if prompt_texts is not None else prompts
    out = []
    for i, c in enumerate(completions):
        text = completion_text(c).strip()
        opened = prompts is not None and prompt_text(prompts[i]).rstrip().endswith("<think>")
        out.append("<think>" + text if opened and not text.startswith("<think>") else text)
    return out


@reward_range(0.0, 1.0)
def think_answer(completions: list, prompts: list | None = None, prompt_texts: list | None = None,
                 **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly ``<think>…</think>`` then ``<answer>…</answer>``
    (only whitespace between and around, each tag once, both blocks non-empty), else 0.0."""
    out = []
    for text in _texts(prompts, completions, prompt_texts):
        m = _STRUCTURE.fullmatch(text)
        ok = (m is not None and all(text.count(t) == 1 for t in _TAGS)
              and m.group(1).strip() != "" and m.group(2).strip() != "")
        out.append(1.0 if ok else 0.0)
    return out


@reward_range(0.0, 1.0)
def tag_count(completions: list, prompts: list | None = None, prompt_texts: list | None = None,
              **kwargs: Any) -> list[float]:
    """0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that occurs
    exactly once (open-r1's partial credit, without its newline requirements)."""
    return [sum(0.25 for t in _TAGS if text.count(t) == 1) for text in _texts(prompts, completions, prompt_texts)]


@reward_range(0.0, 1.0)
def think_format(completions: list, prompts: list | None = None, prompt_texts: list | None = None,
                 **kwargs: Any) -> list[float]:
    """1.0 when the completion is one ``<think>…</think>`` block (each tag once, at the start)
    followed by a non-empty answer in any form, else 0.0: TRL's ``think_format_reward``, which
    also accepts an empty answer, for models that answer in prose or ``\\boxed{}`` rather than
    ``<answer>`` tags."""
    out = []
    for text in _texts(prompts, completions, prompt_texts):
        ok = (text.startswith("<think>") and text.count("<think>") == 1 and text.count("</think>") == 1
              and text.split("</think>", 1)[1].strip() != "")
        out.append(1.0 if ok else 0.0)
    return out


@reward_range(0.0, 1.0)
def code_format(completions: list, prompts: list | None = None, prompt_texts: list | None = None,
                language: str = "python", **kwargs: Any) -> list[float]:
    """1.0 when the completion is ``<think>…</think>`` then ``<answer>…</answer>`` (as
    ``think_answer``) and the answer holds a fenced code block in ``language``
    (```` ```python ... ``` ````), else 0.0: open-r1's ``code_format_reward`` without its
    newline requirements."""
    fence = re.compile(r"```" + re.escape(language) + r"[ \t]*\n.*?```", re.DOTALL | re.IGNORECASE)
    out = []
    for text, ok in zip(_texts(prompts, completions, prompt_texts),
                        think_answer(completions, prompts, prompt_texts)):
        m = _STRUCTURE.fullmatch(text) if ok else None
        out.append(1.0 if m is not None and fence.search(m.group(2)) else 0.0)
    return out


@reward_range(0.0, 1.0)
def reasoning_steps(completions: list, min_steps: int = 3, **kwargs: Any) -> list[float]:
    """min(1, markers / min_steps), counting step markers: ``Step 1:``, ``1.`` at a line
    start, bullets, ``First,``/``Next,``/``Finally,``, and Chinese ``第一步``, ``步骤1``,
    ``首先``, ``其次``, ``然后``, ``接着``, ``最后``."""
    if min_steps < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps}")
    return [min(1.0, len(_STEP.findall(completion_text(c))) / min_steps) for c in completions]


@reward_range(0.0, 1.0)
def hash_answer(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion ends with GSM8K's answer line, ``#### N`` with N a number
    (``-``, ``$``, ``%``, a decimal part and thousands commas allowed: ``#### $1,200.50``), and
    ``####`` occurs nowhere else; else 0.0. Only whitespace may follow the line."""
    out = []
    for c in completions:
        text = completion_text(c).rstrip()
        last = text.rsplit("\n", 1)[-1].strip()
        out.append(1.0 if _HASH_LINE.fullmatch(last) and text.count("####") == 1 else 0.0)
    return out
