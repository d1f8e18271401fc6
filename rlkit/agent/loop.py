"""The multi-turn rollout (TRL 1.16's ``_tool_call_loop`` semantics, rlkit's own code): generate until the
model ends its turn; parse the turn with transformers' response parsing (the tokenizer's ``response_template``,
through ``trl.chat_template_utils.parse_response``); run the tool calls it holds; append the tool results,
rendered by the chat template, to the sequence; generate again; until a turn has no tool call,
``rollout.max_tool_calls`` rounds were run, or the completion budget (``rollout.max_tokens``) is spent.

All turns of a rollout are one completion: the model's tokens (``tool_mask`` 1, the engine's
logprobs) and the tool results' tokens (``tool_mask`` 0, logprob 0.0: not sampled, out of the
loss and of the rollout correction). The tokens are concatenated, never re-tokenized: the
result suffix is what the chat template renders after an assistant turn that ended at EOS (a
dummy conversation with and without the tool messages). A round of tool results that would
push the completion past the budget (or the sequence past the engine's ``max_model_len``) is
rolled back and the rollout ends, as in TRL.

Beyond TRL, a gym-style interaction (``rollout.interaction``) answers each turn that has no tool
call with ``step(message) -> (observation, reward, done)``: the observation is the next user turn
(rendered and masked as tool results are), the rewards add up to the rollout's reward from it.

Differs from TRL where noted: a turn cut at the token budget never calls its tools (its text may hold a
half-written call); a tool call that runs past ``rollout.tool_timeout_s`` fails like a raising tool.

The loop runs on the driver, in a thread (its `Background`), against any engines with
``generate(prompts, n, sampling, seed)``; each round sends only the rollouts still going.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.agent.rollouts import Background
from rlkit.agent.template import prepare_tokenizer, suffix_ids
from rlkit.agent.tools import Environments, _loop, call_tools, schema, tool_dict, tool_methods
from rlkit.errors import UserError
from rlkit.rollout.samples import Sample, Sampling
from rlkit.seeding import derive_seed


@dataclass
class Episode:
    """One rollout in the making."""

    row: int  # index of its row in the batch
    prompt: list[dict[str, Any]]  # the prompt messages (with the environment's reset text)
    tools: dict[str, Callable]
    schemas: list[dict[str, Any]]
    prompt_ids: list[int]
    environment: Any = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    calls: int = 0
    failures: int = 0
    turns: int = 0
    tool_rounds: int = 0
    tool_seconds: float = 0.0
    env_reward: float | None = None  # an interaction's rewards, summed over its steps

    def sample(self, text: str) -> Sample:
        return Sample(self.row, self.prompt_ids, self.completion_ids, text, self.logprobs, self.finish,
                      tool_mask=self.tool_mask, messages=self.messages, tool_calls=self.calls,
                      tool_failures=self.failures, turns=self.turns, env_reward=self.env_reward)

    def add_turn(self, s: Sample, limit: int) -> list[int]:
        """The model's tokens of one generation, cut at the completion budget `limit` (in the loss,
        with the engine's logprobs); returns them."""
        room = limit - len(self.completion_ids)
        ids = list(s.token_ids[:room])
        self.finish = "length" if len(ids) < len(s.token_ids) else s.finish_reason
        self.completion_ids += ids
        self.logprobs += list(s.logprobs[:room])
        self.tool_mask += [1] * len(ids)
        self.turns += 1
        return ids

    def extend(self, messages: list[dict[str, Any]], ids: list[int]) -> None:
        """Tokens the model did not sample (tool results, observations): out of the loss."""
        self.messages += messages
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.tool_mask += [0] * len(ids)


@dataclass
class AgentBatch:
    """What a multi-turn generation gives the scoring: samples (prompt-major) and per sample the
    prompt messages, the prompt as the model saw it and the environment instance (None without)."""

    samples: list[Sample]
    prompts: list[list[dict[str, Any]]]
    prompt_texts: list[str]
    environments: list[Any] | None
    busy: dict[int, float] = field(default_factory=dict)  # engine index -> seconds generating
    tool_seconds: float = 0.0
    pool: Environments | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the rollouts' own (an agent program's)
    returned: bool = False  # an agent program's returned rewards ride on the samples' env_reward

    def release(self) -> None:
        """The rollouts are scored: their environment instances go back to the pool."""
        if self.pool is not None:
            self.pool.release(self.environments)
            self.pool = None


class Agent:
    """Tools and environments of a run, and the turn loop over them."""

    def __init__(self, tokenizer: Any, tools: Sequence[Callable] = (), environments: Environments | None = None,
                 max_tool_calls: int | None = None, timeout_s: float | None = None, max_tokens: int = 256,
                 max_model_len: int | None = None):
        key = "rollout.tools" if tools else "rollout.interaction" if environments and environments.gym else \
            "rollout.environment"
        self.tokenizer = prepare_tokenizer(tokenizer, key)
        self.tools, self.environments = list(tools), environments
        self.max_tool_calls, self.timeout_s = max_tool_calls, timeout_s
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self._schemas = [schema(t, "rollout.tools") for t in self.tools]
        self._env_schemas: dict[type, list[dict[str, Any]]] = {}  # an environment class's tool schemas, once
        self.background = Background("rlkit-agent")

    # ------------------------------------------------------------------ episodes

    def episodes(self, rows: Sequence[Mapping[str, Any]], n: int) -> list[Episode]:
        """`n` episodes per row (prompt-major), each with an environment instance of its own
        (reset with the row's columns; the text it returns joins the last user message)."""
        from rlkit.data.templates import prompt_messages

        expanded = [row for row in rows for _ in range(n)]
        instances = self.environments.draw(expanded) if self.environments else [None] * len(expanded)
        out = []
        for i, (row, env) in enumerate(zip(expanded, instances)):
            prompt = [dict(m) for m in prompt_messages(dict(row))]
            tools, schemas = list(self.tools), list(self._schemas)
            if env is not None:
                observation = self._reset(env, row)
                if observation is not None:
                    prompt[-1] = {**prompt[-1], "content": _join(prompt[-1]["content"], observation)}
                methods = [] if self.environments.gym else tool_methods(env)
                tools += methods
                if type(env) not in self._env_schemas:
                    self._env_schemas[type(env)] = [schema(m, "rollout.environment") for m in methods]
                schemas += self._env_schemas[type(env)]
            ids = self.tokenizer.apply_chat_template(prompt, tools=schemas or None, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            out.append(Episode(i // n, prompt, tool_dict(tools), schemas, list(ids), env))
        return out

    # ------------------------------------------------------------------ the loop

    def run(self, episodes: list[Episode], generate: Callable[[list[list[int]], Sampling, int], list[Sample]],
            sampling: Sampling, seed: int) -> list[Episode]:
        """Play the episodes to their end. `generate(prompt_ids, sampling, seed)` gives one
        sample per prompt (a round sends only the episodes still going)."""
        from trl.chat_template_utils import parse_response

        inputs = [e.prompt_ids for e in episodes]
        active = list(range(len(episodes)))
        rounds = 0
        while active:
            budget = max(self.max_tokens - len(episodes[i].completion_ids) for i in active)
            samples = generate([inputs[i] for i in active], dataclasses.replace(sampling, max_tokens=budget),
                               derive_seed(seed, "turn", rounds))
            calling = []
            for i, s in zip(active, samples):
                e = episodes[i]
                ids = e.add_turn(s, self.max_tokens)
                message = parse_response(self.tokenizer, ids, prefix=inputs[i], tools=e.schemas) if ids else {}
                if message:
                    e.messages.append(message)
                if e.finish == "stop" and message:
                    calling.append(i)
            active = []
            for i in calling:
                e = episodes[i]
                new = self._answer(e, e.messages[-1])
                if not new:
                    continue  # no tool call to run (or none left), the interaction is done
                suffix = self._suffix(new)
                total = len(e.prompt_ids) + len(e.completion_ids) + len(suffix)
                if len(e.completion_ids) + len(suffix) > self.max_tokens or (
                        self.max_model_len is not None and total >= self.max_model_len):
                    continue  # TRL's rollback: the results are dropped, the episode ends as it is
                e.extend(new, suffix)
                inputs[i] = e.prompt_ids + e.completion_ids
                active.append(i)
            rounds += 1
        return episodes

    def _answer(self, e: Episode, message: dict[str, Any]) -> list[dict[str, Any]]:
        """What answers the model's turn: its tool calls' results (up to `max_tool_calls` rounds),
        or an interaction's next user turn; [] ends the episode."""
        if message.get("tool_calls"):
            if self.max_tool_calls is not None and e.tool_rounds >= self.max_tool_calls:
                return []
            results = call_tools(message["tool_calls"], e.tools, self.timeout_s)
            e.calls, e.failures, e.tool_rounds = e.calls + results.calls, e.failures + results.failures, \
                e.tool_rounds + 1
            e.tool_seconds += results.seconds
            return results.messages
        if not (self.environments and self.environments.gym):
            return []
        try:
            observation, reward, done = _settled(e.environment.step(message))
            reward = None if reward is None else float(reward)
        except Exception as exc:  # noqa: BLE001 — the user's environment: one line naming it
            raise UserError(f"rollout.interaction: {type(e.environment).__name__}.step failed: "
                            f"{type(exc).__name__}: {exc} (step(message) returns (observation or None, reward or "
                            "None, done))") from None
        if reward is not None:
            e.env_reward = (e.env_reward or 0.0) + reward
        if done or observation is None:
            return []
        return [{"role": "user", "content": observation}]

    @property
    def _environment_key(self) -> str:
        """The recipe key of the run's environments: a gym-style interaction's or TRL-style ones'."""
        return "rollout.interaction" if self.environments and self.environments.gym else "rollout.environment"

    def _suffix(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """`suffix_ids`; a chat template that cannot render these turns (checked with one call and
        result before launch) is one line naming what sent them."""
        from jinja2 import TemplateError

        try:
            return suffix_ids(self.tokenizer, messages)
        except (TemplateError, ValueError) as e:
            key = "rollout.tools" if messages[0]["role"] == "tool" and self.tools else self._environment_key
            raise UserError(f"{key}: the tokenizer's chat template cannot continue the conversation with "
                            f"{messages[0]['role']} turns ({' '.join(str(e).split())[:200]}): use a model whose "
                            "template renders tool calls and their results") from None

    def _reset(self, env: Any, row: Mapping[str, Any]) -> Any:
        """`env.reset(**row's columns)`: a failure of the user's environment is one line naming it."""
        try:
            return _settled(env.reset(**self.environments.reset_kwargs(row)))
        except Exception as exc:  # noqa: BLE001 — the user's environment: one line naming it
            raise UserError(f"{self._environment_key}: {type(env).__name__}.reset failed: {type(exc).__name__}: "
                            f"{exc} (reset receives every column of the row as a keyword: take **kwargs)") from None

    def generate(self, rows: Sequence[Mapping[str, Any]], engines: Any, sampling: Sampling, n: int,
                 seed: int) -> AgentBatch:
        """`n` multi-turn rollouts per row on `engines` (anything with `generate_async` and
        `gather`, as `rlkit.rollout.engines`, or `generate`), prompt-major."""
        busy: dict[int, float] = {}
        episodes = self.run(self.episodes(rows, n), counted(engines, busy), sampling, seed)
        return agent_batch(episodes, self.text, self.tokenizer, self.environments, busy)

    def text(self, ids: list[int]) -> str:
        """A completion's text, as a sample carries it."""
        return self.tokenizer.decode(ids)


def agent_batch(episodes: list[Episode], text: Callable[[list[int]], str], tokenizer: Any,
                environments: Environments | None, busy: dict[int, float]) -> AgentBatch:
    """The batch of played `episodes` (`text`: a completion's text from its ids)."""
    samples = [e.sample(text(e.completion_ids)) for e in episodes]
    texts = [tokenizer.decode(e.prompt_ids) for e in episodes]
    envs = [e.environment for e in episodes] if environments else None
    return AgentBatch(samples, [e.prompt for e in episodes], texts, envs, busy,
                      sum(e.tool_seconds for e in episodes), environments)


def counted(engines: Any, busy: dict[int, float]) -> Callable[[list[list[int]], Sampling, int], list[Sample]]:
    """`generate(prompts, sampling, seed)`: one sample per prompt on `engines` (anything with
    `generate_async` and `gather`, as `rlkit.rollout.engines`, or `generate`: one engine in this
    process), adding each engine's seconds to `busy` (engine index -> seconds)."""
    def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Sample]:
        if not hasattr(engines, "generate_async"):
            return engines.generate(prompts, 1, sampling, seed)
        calls = engines.generate_async(prompts, 1, sampling, seed)
        samples = engines.gather(calls)
        for call in calls:
            if getattr(call, "seconds", None) is not None:
                busy[call.index] = busy.get(call.index, 0.0) + call.seconds
        return samples
    return generate


async def _await(aw: Any) -> Any:
    return await aw


def _settled(out: Any) -> Any:
    """A user environment's return value; an awaitable (an `async def` method) is run to its end
    on the tools' event loop."""
    if inspect.isawaitable(out):
        return asyncio.run_coroutine_threadsafe(_await(out), _loop()).result()
    return out


def _join(content: Any, observation: Any) -> Any:
    """The last user message's content with the environment's reset text after it (TRL's rule,
    for text and for content blocks)."""
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return content + observation


def rollout_metrics(samples: Sequence[Sample], tool_seconds: float) -> dict[str, float]:
    """TRL's tool metrics (`tools/call_frequency`: calls per rollout, `tools/failure_frequency`:
    failures per call) and rlkit's: turns per rollout, the share of completion tokens that are
    tool results (masked), seconds in tools."""
    n = max(len(samples), 1)
    calls = sum(s.tool_calls for s in samples)
    tokens = sum(len(s.token_ids) for s in samples)
    masked = sum(len(s.tool_mask) - sum(s.tool_mask) for s in samples if s.tool_mask is not None)
    return {"tools/call_frequency": calls / n,
            "tools/failure_frequency": sum(s.tool_failures for s in samples) / calls if calls else 0.0,
            "tools/turns_mean": sum(s.turns for s in samples) / n,
            "tools/masked_frac": masked / tokens if tokens else 0.0,
            "time/tools": tool_seconds}
