"""Waiting on Ray actor calls with a deadline, so that a hung actor becomes a one-line error
naming it and the phase, not a run that waits forever.

`wait_all` also fails fast: the first call that raises ends the wait (the others may be stuck
in a collective with the failed one), and a user-facing error raised inside an actor comes out
as itself, without Ray's remote traceback.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlkit.errors import FaultError, UserError


def wait_all(futures: Sequence[Any], owners: Sequence[str], phase: str, timeout_s: float | None = None,
             knob: str = "rollout.sync_timeout_s") -> list[Any]:
    """The results of `futures` (Ray object refs) in order; `owners[i]` names who runs
    `futures[i]` ("engine 1"). A `FaultError` if some are not done `timeout_s` seconds from now
    (None or 0: no limit); `knob` is the recipe key that sets the limit."""
    import ray

    index = {ref: i for i, ref in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    pending = list(futures)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            late = sorted({owners[index[ref]] for ref in pending}, key=owners.index)
            who = late[0] + (f" (and {', '.join(late[1:])})" if len(late) > 1 else "")
            raise FaultError(f"{who} did not finish {phase} within {timeout_s:g} s ({knob}); "
                             f"it is hung or far slower than expected: see its log, or raise {knob}")
        for ref in ready:
            results[index[ref]] = _get(ref)
    return results


def _get(ref: Any) -> Any:
    """`ray.get`; an actor's `UserError` is raised as itself (one line), other errors as Ray's."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserError):
            raise e.cause from None
        raise
