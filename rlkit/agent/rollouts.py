"""What a run's multi-turn rollouts are to the driver (`Rollouts`): the turn loop over tools and
environments (`loop.Agent`), the inline calculator (`calculator.Calculator`) and an agent program
(`program.ProgramAgent`) each generate a batch of rollouts and hold the driver threads they run in
(`Background`), whose generations a weight sync waits for (the engines' `before_sync`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from rlkit.rollout.samples import Sampling


class Background:
    """Driver threads that run generations, and the generations in flight."""

    def __init__(self, name: str):
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix=name)
        self._running: set[Future] = set()
        self._lock = threading.Lock()

    def start(self, generate: Callable[..., Any], *args: Any) -> Future:
        """`generate(*args)` in a driver thread; returns at once (its future)."""
        future = self._threads.submit(generate, *args)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future) -> None:
        with self._lock:
            self._running.discard(future)

    def wait_idle(self) -> None:
        """Until no generation started here is running: the engines may then take new weights, so
        every turn of a rollout comes from the policy that started it (as a single-turn generation,
        queued in the engine before the sync, does)."""
        with self._lock:
            running = list(self._running)
        for future in running:
            future.exception()  # waits; an error is raised where the result is taken


class Rollouts(Protocol):
    """A kind of multi-turn rollouts, as the driver uses it."""

    environments: Any  # `tools.Environments` (an interaction's rewards come from them), or None
    background: Background

    def generate(self, rows: Sequence[Mapping[str, Any]], engines: Any, sampling: Sampling, n: int,
                 seed: int) -> Any:
        """`n` rollouts per row on `engines`, prompt-major: a `loop.AgentBatch`."""
        ...
