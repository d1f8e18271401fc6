"""An inline calculator (`rollout.calculator: true`): the arithmetic in a completion is the
calculator's, the reasoning is the model's.

GSM8K was written with one (Cobbe et al. 2021: when the model writes `<<48/2=` the calculator
writes `24>>`); a small model needs it more than a large one: SmolLM2-135M-Instruct gets 57% of the
equations it writes wrong ("10*57=530"), so three quarters of its solutions to GSM8K problems hold
a wrong line whatever their reasoning, and an RL reward for the final answer rarely fires.

Generation stops after every token whose text holds "="; when the completion then ends in an
arithmetic expression and "=" (numbers, `+ - * / x × ÷`, parentheses, currency signs and thousands commas;
`7 * 12 =`, `<<48/2=`), the expression's value is appended as tokens the model did not sample
(`tool_mask` 0, logprob 0.0: out of the loss and of the rollout correction, like a tool's result),
and generation goes on; any other "=" (`x = 5 apples =`) just goes on. Completions stay token
sequences (never re-tokenized). The same loop runs in GRPO and in `rlkit eval`, with any template.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlkit.agent.loop import AgentBatch, Episode, agent_batch, counted
from rlkit.agent.rollouts import Background
from rlkit.rollout.samples import Sample, Sampling
from rlkit.seeding import derive_seed

_SIGNS = {"+": "+", "-": "-", "*": "*", "/": "/", "x": "*", "×": "*", "÷": "/", "(": "(", ")": ")"}
_CURRENCY = "$£€¥"
_CHARACTERS = set("0123456789., " + _CURRENCY) | set(_SIGNS)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 120  # characters: longer "expressions" are prose the pattern caught, not a calculation


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("not arithmetic")


def calculate(text: str) -> str | None:
    """The value of the arithmetic expression `text` ends with (before its final "="), written as
    a number is (`570`, `2.5`, `0.3333`: at most 4 decimals), or None when `text` does not end so
    or the expression cannot be evaluated (division by zero).

    The expression is the longest run of digits, signs, parentheses, currency signs, commas and spaces before
    the "=" (read backwards, at most MAX_EXPRESSION characters: linear time, whatever the model
    wrote), less leading signs; it needs a number and an operator."""
    text = text.rstrip()
    if not text.endswith("="):
        return None
    start = end = len(text) - 1
    while start > 0 and text[start - 1] in _CHARACTERS and end - start < MAX_EXPRESSION:
        start -= 1
    if start > 0 and text[start - 1] in _CHARACTERS:
        return None  # longer than MAX_EXPRESSION
    if start > 0 and text[start - 1].isalpha() and text[start] == "x":
        start += 1  # "box 2 * 3": the x ends a word
    expression = text[start:end].strip().lstrip("+*/x×÷.,) ").replace(",", "")
    expression = "".join(_SIGNS.get(c, c) for c in expression if c not in _CURRENCY)
    if not any(c.isdigit() for c in expression) or not any(c in "+-*/" for c in expression.lstrip("-")):
        return None
    try:
        value = round(float(_value(ast.parse(expression, mode="eval").body)), 4)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
        return None
    return str(int(value)) if value.is_integer() else f"{value:.4f}".rstrip("0")


class Calculator:
    """The rollouts of a run with the inline calculator (`rollouts.Rollouts`): `Agent`'s samples
    (tool_mask, tool_calls = the calculator's answers), a loop of its own."""

    def __init__(self, tokenizer: Any, render: Callable[[Mapping[str, Any]], str], max_model_len: int | None = None,
                 kv_tokens: int | None = None):
        self.tokenizer, self.render, self.kv_tokens = tokenizer, render, kv_tokens
        self.environments, self.max_model_len = None, max_model_len  # the budget comes with each call's sampling
        vocab = tokenizer.get_vocab().values()
        self.stop_ids = tuple(sorted(i for i in vocab if "=" in tokenizer.decode([i])))
        self.background = Background("rlkit-calculator")

    def generate(self, rows: Sequence[Mapping[str, Any]], engines: Any, sampling: Sampling, n: int,
                 seed: int) -> AgentBatch:
        """`n` rollouts per row on `engines`, prompt-major; the rewards see them as single-turn
        ones: a chat row's prompt messages and `[{"role": "assistant", "content": text}]`, a text
        row's rendered prompt and the text."""
        busy: dict[int, float] = {}
        episodes = self.run(self.episodes(rows, n), counted(engines, busy), sampling, seed)
        batch = agent_batch(episodes, self.text, self.tokenizer, None, busy)
        chat = [isinstance(row.get("prompt"), list) for row in rows for _ in range(n)]  # as single-turn scoring
        batch.samples = [dataclasses.replace(s, messages=[{"role": "assistant", "content": s.text}] if c else None)
                         for s, c in zip(batch.samples, chat)]
        batch.prompts = [p if c else text for p, text, c in zip(batch.prompts, batch.prompt_texts, chat)]
        return batch

    def text(self, ids: list[int]) -> str:
        """The completion's text as vLLM gives a single-turn one: without special tokens (EOS)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def episodes(self, rows: Sequence[Mapping[str, Any]], n: int) -> list[Episode]:
        """`n` episodes per row (prompt-major): the prompt as the run's template renders it, token
        ids as the engines tokenize text."""
        from rlkit.data.templates import prompt_messages

        out = []
        for i, row in enumerate(row for row in rows for _ in range(n)):
            ids = self.tokenizer(self.render(row)).input_ids
            out.append(Episode(i // n, [dict(m) for m in prompt_messages(dict(row))], {}, [], list(ids)))
        return out

    def run(self, episodes: list[Episode], generate: Callable[[list[list[int]], Sampling, int], list[Sample]],
            sampling: Sampling, seed: int) -> list[Episode]:
        """Play the episodes to their end: generate until a token with "=" (or the end); append the
        calculator's answer when there is one; go on with the episodes that stopped at "=". The
        completion budget is `sampling.max_tokens` (the rollouts', or an evaluation's).

        Episodes are played in groups whose prompts and budgets fit `kv_tokens` (the engines' KV
        caches), each group to its end: every round sends its episodes' whole sequences again, and
        the engines reuse their prefix cache only while it holds them all (an eval of 1020 rows on
        a 1 GiB CPU cache held ~115 of them)."""
        groups: list[list[Episode]] = []
        held = 0
        for e in episodes:
            need = len(e.prompt_ids) + sampling.max_tokens
            if not groups or (self.kv_tokens is not None and held + need > self.kv_tokens):
                groups.append([])
                held = 0
            groups[-1].append(e)
            held += need
        for k, group in enumerate(groups):
            self._play(group, generate, sampling, derive_seed(seed, "group", k) if k else seed)
        return episodes

    def _play(self, episodes: list[Episode], generate: Callable[[list[list[int]], Sampling, int], list[Sample]],
              sampling: Sampling, seed: int) -> None:
        limit = sampling.max_tokens
        sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted({*sampling.stop_token_ids,
                                                                                 *self.stop_ids})))
        stops = set(self.stop_ids)
        active, rounds = list(range(len(episodes))), 0
        while active:
            budget = max(limit - len(episodes[i].completion_ids) for i in active)
            samples = generate([episodes[i].prompt_ids + episodes[i].completion_ids for i in active],
                               dataclasses.replace(sampling, max_tokens=budget), derive_seed(seed, "turn", rounds))
            going = []
            for i, s in zip(active, samples):
                e = episodes[i]
                ids = e.add_turn(s, limit)
                if e.finish != "stop" or not ids or ids[-1] not in stops:
                    continue  # the end of the completion, at EOS, a stop string or the token budget
                text = self.tokenizer.decode(e.completion_ids)
                value = calculate(text)
                answer = [] if value is None else \
                    self.tokenizer.encode((" " if text.endswith(" =") else "") + value, add_special_tokens=False)
                if len(e.completion_ids) + len(answer) >= limit or (
                        self.max_model_len is not None and
                        len(e.prompt_ids) + len(e.completion_ids) + len(answer) >= self.max_model_len):
                    e.finish = "length"
                    continue
                if answer:
                    e.extend([], answer)
                    e.calls += 1
                going.append(i)
            active, rounds = going, rounds + 1


def kv_cache_tokens(rollout: Any, model_path: str, dtype: str) -> int | None:
    """How many tokens the engines' KV caches hold together (`rollout.kv_cache_gib` each, as CPU
    engines allocate it; None where the model's config cannot be read)."""
    from pathlib import Path

    from rlkit.estimate.arch import Arch, config_json
    from rlkit.estimate.memory import width_bytes

    if not rollout.kv_cache_gib or not (Path(model_path) / "config.json").is_file():
        return None
    try:
        config, name = config_json(model_path)
        arch = Arch.from_config(config, name)
    except Exception:  # noqa: BLE001 - a config the estimate cannot read: play all episodes at once
        return None
    if dtype == "auto":  # vLLM's: the config's
        dtype = "fp32" if str(config.get("dtype") or config.get("torch_dtype")) in ("float32", "None") else "bf16"
    per_token = arch.kv_bytes_per_token(width_bytes(dtype, None))
    engines = 1 if rollout.colocate else rollout.num_engines
    return int(rollout.kv_cache_gib * 2**30 // per_token) * engines
