"""The calculator task for the tiny tool-calling model (`build_tiny_model(..., tools=True)` in
rlkit/tiny.py): sums of two 2-digit numbers, the `add` tool (beside `multiply` and `subtract`, to
pick by name) and a shaped reward for the procedure (`calculator_steps`). A recipe names them
`rlkit.tiny_tools:add` and `rlkit.tiny_tools:calculator_steps`; `write_tool_task` writes the SFT
transcripts, the no-tool and mixed rows, and the GRPO prompts.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def subtract(a: int, b: int) -> int:
    """Subtract the second integer from the first.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a - b


def calculator_steps(completions: list, prompts: list, **kwargs: Any) -> list[float]:
    """A shaped reward for the calculator task, each step of the right procedure worth a share:
    1/3 for each argument of the first `add` call that copies the question's numbers (in order),
    1/3 for a final answer that repeats the last tool result. An exact answer scores 1 through
    this path too; a direct answer without a call scores 0 here (exact match rewards it)."""
    out = []
    for completion, prompt in zip(completions, prompts):
        question = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        numbers = [int(x) for x in re.findall(r"\d+", question)[:2]]
        calls = [c["function"] for m in completion if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        results = [m["content"] for m in completion if m.get("role") == "tool"]
        score = 0.0
        if calls and calls[0].get("name") == "add" and isinstance(calls[0].get("arguments"), dict):
            args = calls[0]["arguments"]
            score += sum(args.get(k) == n for k, n in zip(("a", "b"), numbers)) / 3
        final = completion[-1] if completion and completion[-1].get("role") == "assistant" else None
        if results and final is not None and not final.get("tool_calls"):
            score += (str(final.get("content") or "").strip() == str(results[-1]).strip()) / 3
        out.append(score)
    return out


def tool_rows(rng: random.Random, pairs: list[tuple[int, int]]) -> list[dict]:
    """A transcript per pair: the question, a call of `add`, its result, the bare answer. Each
    offers `add` among a random choice of other tools, in random order (the model picks by name)."""
    from transformers.utils import get_json_schema

    schemas = {f.__name__: get_json_schema(f) for f in (add, multiply, subtract)}
    rows = []
    for a, b in pairs:
        names = ["add"] + rng.sample(["multiply", "subtract"], rng.randint(0, 2))
        rng.shuffle(names)
        tools = [schemas[n] for n in names]
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}=?"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "name": "add", "content": str(a + b)},
                                  {"role": "assistant", "content": str(a + b)}], "tools": tools})
    return rows


def write_tool_task(out_dir: str | Path, seed: int = 0, n_sft: int = 512, n_train: int = 256,
                    n_eval: int = 64, tool_share: float = 0.3) -> dict[str, Path]:
    """The calculator task: sums of two 2-digit numbers (8100 of them, too many to memorise from a
    few hundred transcripts), so the model must call `add` (this module's; a recipe names it
    `rlkit.tiny_tools:add`). Writes
    `sft_tools.jsonl` (transcripts in TRL's conversational tool format, with a `tools` column),
    `sft_direct.jsonl` (the same questions answered without a tool: the no-tool baseline),
    `sft_mixed.jsonl` (the same questions, tools offered in every row, a `tool_share` of them
    answered through `add` and the rest directly: a few steps on them after the transcripts give a
    model that can use the tool but seldom calls it),
    `grpo_train.jsonl` and `grpo_eval.jsonl` (chat prompts with the bare `answer`); SFT, GRPO
    and held-out rows draw disjoint pairs. Deterministic for `seed`."""
    rng = random.Random(seed)
    pairs = list({(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(3 * (n_sft + n_train + n_eval))})
    rng.shuffle(pairs)
    sft, train, held = (pairs[:n_sft], pairs[n_sft:n_sft + n_train],
                        pairs[n_sft + n_train:n_sft + n_train + n_eval])
    prompts = lambda ps: [{"prompt": [{"role": "user", "content": f"{a}+{b}=?"}], "answer": str(a + b)}  # noqa: E731
                          for a, b in ps]
    direct = [{"messages": [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": str(a + b)}]}
              for a, b in sft]
    transcripts = tool_rows(rng, sft)
    pick = random.Random(f"{seed}-mixed")  # its own stream: the other files stay as they were
    mixed = [row if pick.random() < tool_share else
             {"messages": [row["messages"][0], row["messages"][-1]], "tools": row["tools"]} for row in transcripts]
    files = {"sft_tools": transcripts, "sft_direct": direct, "sft_mixed": mixed, "grpo_train": prompts(train),
             "grpo_eval": prompts(held)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return paths
