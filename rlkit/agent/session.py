"""An agent program's rollouts as the endpoint keeps them (rlkit/agent/endpoint.py): a rollout's
session and its samples (`Segment`: the exact tokens of every turn, the model's in the loss with
the engine's logprobs), and the requests of one generation batched into one engine call (`Batcher`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlkit.agent.chat_api import RequestError
from rlkit.rollout.samples import Sample


@dataclass
class Segment:
    """One sample of a rollout: the prompt it was forked at, then every token since (the model's,
    in the loss with the engine's logprobs; the rest masked), and the conversation as last sent."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def append(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Tokens after the history: sampled (with `logprobs`: in the loss) or not (masked)."""
        self.completion_ids += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)


@dataclass
class Session:
    """One rollout's conversation with the endpoint."""

    id: str
    key: str
    batcher: Batcher
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    forks: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # kind -> requests refused
    first_error: str | None = None
    overridden: set[str] = field(default_factory=set)  # sampling keys the harness sent, overridden
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # Responses API: id -> conversation
    closed: bool = False
    served_s: float = 0.0  # seconds answering requests, less the wait for the engines
    lock: asyncio.Lock | None = None

    def refused(self, e: RequestError) -> None:
        self.errors[e.kind] = self.errors.get(e.kind, 0) + 1
        if self.first_error is None:
            self.first_error = f"{e.kind}: {e}"


class Batcher:
    """The requests of one generation, sent to the engines together: `generate(prompts, budget)`
    gives one sample per prompt; a call goes once `live()` requests wait (every running program
    has one) or `wait_s` after the first. One call at a time; an engine failure fails the call's
    requests and is kept in `error` (the generation raises it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, generate: Callable[[list[list[int]], int], list[Sample]],
                 live: Callable[[], int], wait_s: float):
        self.loop, self.generate, self.live, self.wait_s = loop, generate, live, wait_s
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None
        self.error: BaseException | None = None
        self.calls = 0
        self.seconds = 0.0

    async def __call__(self, ids: list[int], budget: int) -> tuple[Sample, float]:
        future = self.loop.create_future()
        self.pending.append((ids, budget, future))
        self._kick()
        return await future

    def poke(self) -> None:
        """A program ended (from any thread): the requests waiting may now be all there are."""
        self.loop.call_soon_threadsafe(self._kick)

    def _kick(self, due: bool = False) -> None:
        if self.busy or not self.pending:
            return
        if due or len(self.pending) >= self.live() or self.wait_s == 0:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self._flush()
        elif self.timer is None:
            self.timer = self.loop.call_later(self.wait_s, self._due)

    def _due(self) -> None:
        self.timer = None
        self._kick(due=True)

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        self.busy = True
        t0 = time.perf_counter()
        job = self.loop.run_in_executor(None, self.generate, [b[0] for b in batch], max(b[1] for b in batch))

        def done(job: asyncio.Future) -> None:
            seconds = time.perf_counter() - t0
            self.busy, self.calls, self.seconds = False, self.calls + 1, self.seconds + seconds
            if job.exception() is not None:
                self.error = job.exception()
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(RequestError(503, "engine", f"the engines failed: {self.error}"))
            else:
                for (*_, future), sample in zip(batch, job.result()):
                    if not future.done():
                        future.set_result((sample, seconds))
            self._kick()

        job.add_done_callback(done)
