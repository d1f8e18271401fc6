"""What the rollout side takes from the learners, without knowing them: the `Learners` the engines
are synced from (and, colocated, live in), and the loads a deferred sync left running on the
engines (`PendingLoads`). The learner side (`rlkit.learner.group.LearnerGroup`) is one `Learners`;
what crosses between the two sides is in `rlkit/sync/` and `rlkit/transports.py`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlkit.actors.roles import call
from rlkit.rollout.worker import RolloutWorker
from rlkit.transports import SyncRequest


class Learners(Protocol):
    """The learners as the engines see them: their actors (a colocated engine's host), their
    current policy pushed as a request asks, and the engines they hold when colocated."""

    actors: list[Any]

    @property
    def size(self) -> int: ...

    def push_weights(self, request: SyncRequest) -> list[dict[str, Any] | None]: ...

    def start_engines(self, model_path: str, per_rank_options: Sequence[dict[str, Any]],
                      timeout_s: float | None = None) -> list[float]: ...

    def engine_sequence_logprobs(self, sequences: list[Any],
                                 timeout_s: float | None = None) -> list[list[list[float]]]: ...

    def sleep_engines(self) -> None: ...


@dataclass
class PendingLoads:
    """The engines' loads of a deferred push (`ObjectStoreSync.push(defer=True)`), then their cache
    resets: the futures, the engine that runs each (`owners`), and the buckets, to load again into
    an engine restarted before they finished."""

    futures: list[Any]
    owners: list[str]
    buckets: list[Any]

    def without(self, engines: Iterable[str]) -> None:
        """Forget the loads of `engines` (restarted: theirs are lost)."""
        gone = set(engines)
        kept = [i for i, owner in enumerate(self.owners) if owner not in gone]
        self.futures, self.owners = [self.futures[i] for i in kept], [self.owners[i] for i in kept]

    def load_into(self, engine: Any, name: str) -> None:
        """Send the buckets and a cache reset to `engine` (actor handle, named `name`) as well."""
        self.futures += [call(engine, RolloutWorker.update_weights, b, reset_cache=False) for b in self.buckets]
        self.futures.append(call(engine, RolloutWorker.reset_prefix_cache))
        self.owners += [name] * (len(self.buckets) + 1)
