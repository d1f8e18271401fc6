"""An LLM judge: a generative model asked to grade each completion, on vLLM engines of its own.

Recipe::

    rewards:
      - fn: rewards.llm_judge:LLMJudge
        args:
          path: /models/judge                    # a local HF folder vLLM serves
          template: "Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nScore 0-10:"
          scale: [0, 10]                         # a number in the reply, mapped to [0, 1]
          # verdicts: {correct: 1.0, incorrect: 0.0}   # or a verdict word, scored as given
          engines: 1
          device: cuda                           # its engines' device kind (cpu, cuda, rocm, npu)

The template is a Python format string over ``prompt``, ``completion`` and the row's columns
(``{answer}``); with ``chat: true`` (default) it is the user turn of the judge's own chat template
when its tokenizer has one. The judge's engines are its own (never the policy's, whose weights
change every step): ``engines`` Ray actors named "the LLM judge" (and its number), each a vLLM
engine on ``devices`` devices of its kind, started as rlkit starts every role; a step's samples
are split over them and each call waits at most ``timeout_s``. Without Ray (`rlkit reward test`)
one engine runs in the caller's process. Replies are greedy (``temperature: 0``) and at most
``max_tokens`` long.

Parsing: with ``verdicts``, the last of their words in the reply (whole words, any case) scores
its value; else the first number in the reply inside ``scale`` scores ``(x - low) / (high - low)``.
A reply with neither scores ``unparseable`` and is counted in ``reward/LLMJudge/errors`` (said
once in the log); it never fails the step.
"""

from __future__ import annotations

import os
import re
import string
from typing import Any

from rlkit.reward.contract import Failed, completion_text, prompt_text, reward_range

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _judge_range(verdicts: dict[str, float] | None = None, unparseable: float = 0.0, **_: Any) -> tuple[float, float]:
    values = [*(verdicts or {0: 0.0, 1: 1.0}).values(), unparseable]
    return float(min(values)), float(max(values))


def parse_score(reply: str, verdicts: dict[str, float] | None, scale: tuple[float, float]) -> float | None:
    """The score a reply gives: the value of the last verdict word in it (whole words, any case),
    or without verdicts the first number inside `scale` mapped to [0, 1]; None when it has neither."""
    if verdicts:
        words = sorted(verdicts, key=len, reverse=True)
        found = re.findall(r"\b(" + "|".join(map(re.escape, words)) + r")\b", reply, re.I)
        if not found:
            return None
        lower = {w.lower(): v for w, v in verdicts.items()}
        return float(lower[found[-1].lower()])
    low, high = scale
    for m in NUMBER.finditer(reply):
        x = float(m.group())
        if low <= x <= high:
            return (x - low) / (high - low)
    return None


class _JudgeEngine:
    """One vLLM engine of the judge (in its actor's process, or the caller's)."""

    def __init__(self, path: str, chat: bool, options: dict[str, Any], index: int = 0) -> None:
        from rlkit.console import name_worker_log
        from rlkit.rollout.worker import RolloutWorker

        name_worker_log(f"judge-{index}")
        self.engine = RolloutWorker(path, index=index, **options)
        tok = self.engine.llm.get_tokenizer()
        self.template = tok if chat and getattr(tok, "chat_template", None) else None

    def ready(self) -> bool:
        return True

    def replies(self, questions: list[str], max_tokens: int, temperature: float, seed: int) -> list[str]:
        """The judge's reply to each question (its chat template's user turn where it has one)."""
        if self.template is not None:
            questions = [self.template.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True) for q in questions]
        samples = self.engine.generate(questions, n=1, temperature=temperature, max_tokens=max_tokens, seed=seed)
        return [s.text for s in samples]


@reward_range(_judge_range)
class LLMJudge:
    """Scores each completion by asking a generative model (see the module's docstring).

    path: the judge model's local folder. template: the question (a format string over
    ``prompt``, ``completion`` and the row's columns). verdicts: reply word -> score (None:
    parse a number inside ``scale`` instead, scored on [0, 1]). unparseable: the score of a reply
    with neither (counted as an error). chat: use the judge's chat template. max_tokens,
    temperature, seed: its replies. engines: its vLLM engines (Ray actors when Ray runs and
    ``ray_actor``), each on ``devices`` devices of ``device``'s kind with ``num_cpus`` CPUs and
    ``resources``; max_model_len, dtype, gpu_memory_utilization, kv_cache_gib (on a CPU): each
    engine's vLLM settings. timeout_s / start_timeout_s: the longest a batch / the start may take.
    """

    def __init__(self, path: str, template: str = "{prompt}{completion}", verdicts: dict[str, float] | None = None,
                 scale: tuple[float, float] | list[float] = (0, 10), unparseable: float = 0.0, chat: bool = True,
                 max_tokens: int = 32, temperature: float = 0.0, seed: int = 0, engines: int = 1,
                 device: str = "cpu", devices: float = 1, num_cpus: float = 1,
                 resources: dict[str, float] | None = None, ray_actor: bool = True, max_model_len: int = 2048,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.5, kv_cache_gib: float = 1.0,
                 timeout_s: float = 600, start_timeout_s: float = 900) -> None:
        from rlkit.actors.served import Serving

        low, high = (float(x) for x in scale)
        if not low < high:
            raise ValueError(f"scale: expected [low, high] with low < high, got {list(scale)}")
        if verdicts is not None and not verdicts:
            raise ValueError("verdicts: give at least one word, or leave it out to parse a number")
        self.fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        if not {"prompt", "completion"} & self.fields:
            raise ValueError(f"template: {template!r} names neither {{prompt}} nor {{completion}}; the judge "
                             "would not see what it grades")
        self.path, self.template, self.verdicts, self.scale = path, template, verdicts, (low, high)
        self.unparseable, self.chat, self.max_tokens = unparseable, chat, max_tokens
        self.temperature, self.seed, self.calls = temperature, seed, 0
        self.options = dict(dtype=dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_gib=None if device not in ("cpu",) else kv_cache_gib)
        self.serving = Serving(device, devices, num_cpus, dict(resources or {}), actors=engines, ray=ray_actor,
                               timeout_s=timeout_s, start_timeout_s=start_timeout_s, what="the LLM judge")
        self._engines: list[Any] = []
        self._local: _JudgeEngine | None = None

    def ray_resources(self) -> list[dict[str, float]] | None:
        """What each of its engines' actors asks of the Ray cluster; None in-process."""
        return [self.serving.bundle()] * self.serving.actors if self.serving.ray else None

    def memory_parts(self) -> dict[str, Any]:
        """What the estimate counts for it: `engines` vLLM engines of the model at `path`."""
        return {"kind": "engine", "path": self.path, "dtype": self.options["dtype"], "actors": self.serving.actors,
                "max_model_len": self.options["max_model_len"], "kv_cache_gib": self.options["kv_cache_gib"] or 0,
                "gpu_memory_utilization": self.options["gpu_memory_utilization"], "device": self.serving.device,
                "served": self.serving.ray}

    def rlkit_check_row(self, row: dict[str, Any]) -> None:
        """Before launch: every field the template names is the prompt, the completion or a column."""
        missing = sorted(self.fields - {"prompt", "completion"} - set(row))
        if missing:
            raise ValueError(f"its template names {{{missing[0]}}}, which the row does not have (columns: "
                             f"{', '.join(sorted(row))})")

    def setup(self) -> None:
        if self._engines or self._local is not None:
            return
        if self.serving.in_ray():
            from rlkit.rollout.worker import cpu_engine_env

            info = self.serving.info
            env = None if info.is_accelerator else cpu_engine_env(self.options["kv_cache_gib"])
            self._engines = self.serving.start(_JudgeEngine, self.path, self.chat, self.options, env=env, indexed=True)
            self.serving.wait([e.ready.remote() for e in self._engines], self.serving.names(), "loading its model",
                              start=True)
            return
        if not self.serving.info.is_accelerator:  # vLLM-CPU in this process: as the policy's engines run
            from rlkit.rollout.worker import cpu_engine_env

            for key, value in cpu_engine_env(self.options["kv_cache_gib"]).items():
                os.environ.setdefault(key, value)
        self._local = _JudgeEngine(self.path, self.chat, self.options)

    def questions(self, prompts: list, completions: list, columns: dict[str, list]) -> list[str]:
        """The template filled for each sample."""
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            values = {k: columns[k][i] for k in self.fields if k in columns}
            out.append(self.template.format(**{**values, "prompt": prompt_text(p), "completion": completion_text(c)}))
        return out

    def ask(self, questions: list[str]) -> list[str]:
        """The judge's replies, the batch split over its engines in order."""
        self.setup()
        self.calls += 1
        seed = self.seed + self.calls
        if self._local is not None:
            return self._local.replies(questions, self.max_tokens, self.temperature, seed)
        from rlkit.rollout.generation import shards

        parts = shards(questions, len(self._engines))
        refs = [e.replies.remote(part, self.max_tokens, self.temperature, seed)
                for e, part in zip(self._engines, parts) if part]
        names = self.serving.names()[:len(refs)]
        return [r for part in self.serving.wait(refs, names, "judging a batch") for r in part]

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        replies = self.ask(self.questions(list(prompts), list(completions), columns))
        out: list[float] = []
        for reply in replies:
            score = parse_score(reply, self.verdicts, self.scale)
            if score is None:
                shown, what = reply.strip().replace("\n", " ")[:80], "verdict" if self.verdicts else "score"
                score = Failed(self.unparseable, f"the LLM judge's reply has no {what} it can read: {shown!r}")
            out.append(score)
        return out

