"""What a rollout engine gives back (`Sample`) and how it samples (`Sampling`): plain data, shared by
the engines (`rollout.py`, `streaming.py`), the driver and the agent loops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One completion. `logprobs[t]` is the logprob of `token_ids[t]` (see module docstring);
    `finish_reason` is "stop" (EOS / stop string / stop token) or "length" (hit max_tokens).
    A multi-turn rollout (`rlkit.agent.loop`) also has `tool_mask` (0 on the tokens of tool
    results, whose logprob is 0.0: they were not sampled), the completion as chat `messages`
    (assistant and tool turns, as TRL passes them to rewards) and its tool counts."""

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    tool_mask: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 1
    env_reward: float | None = None  # a gym-style interaction's rewards, summed over its steps
    forks: list[Sample] | None = None  # an agent program's earlier samples of this rollout (rlkit/agent/program.py)
    versions: list[int] | None = None  # streamed: the policy version that sampled each token (rollout/streaming.py)


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (`generate`'s keyword arguments); temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # the calculator's (rlkit.agent.calculator): tokens holding "="

    def kwargs(self) -> dict[str, Any]:
        return dict(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                    stop=list(self.stop) or None, stop_token_ids=list(self.stop_token_ids) or None)


def own_limits(prompt: dict[str, Any], max_tokens: int) -> dict[str, int]:
    """A prompt dict's own sampling limits, taken out of it (`limits`: a row's `max_tokens` and
    `min_tokens` columns, `Task.engine_prompts`), within the recipe's `max_tokens`."""
    own = prompt.pop("limits", None) or {}
    return {k: min(int(v), max_tokens) for k, v in own.items()}
