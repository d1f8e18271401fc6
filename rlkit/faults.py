"""Faults on purpose, for the tests that show a fault is caught and reported (not for users).

`RLKIT_FAULT` holds `;`-separated faults; Ray actors inherit it from the driver's environment:
- `sync_skip:<text>[:<engine>]`: rollout engine `<engine>` (every engine if none is named)
  drops the synced tensors whose HF name contains `<text>` (a sync that silently misses one).
- `hang:<phase>:<engine>[:<after>]`: rollout engine `<engine>` sleeps for an hour in its
  `<phase>` call (`generate`, `weight_sync`) after `<after>` such calls went through (default
  0), as a wedged engine would.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from typing import Any

VARIABLE = "RLKIT_FAULT"
_calls: collections.Counter = collections.Counter()  # (phase, engine) -> calls seen in this process


def _faults(kind: str) -> list[list[str]]:
    """The arguments of every fault of `kind` in `RLKIT_FAULT`."""
    out = []
    for item in os.environ.get(VARIABLE, "").split(";"):
        name, _, args = item.strip().partition(":")
        if name == kind:
            out.append(args.split(":"))
    return out


def skip_tensors(named: Iterable[tuple[str, Any]], engine: int) -> Iterable[tuple[str, Any]]:
    """`named` without the tensors a `sync_skip` fault drops at this engine (`named` itself when
    none is set)."""
    texts = [args[0] for args in _faults("sync_skip") if len(args) == 1 or args[1] == str(engine)]
    if not texts:
        return named
    return (item for item in named if not any(t in item[0] for t in texts))


def hang_here(phase: str, engine: int) -> None:
    """Sleep for an hour if a `hang` fault names this phase and engine, and this is a call after
    the ones it lets through."""
    _calls[phase, engine] += 1
    for args in _faults("hang"):
        if args[:2] == [phase, str(engine)] and _calls[phase, engine] > int((args[2:] or ["0"])[0]):
            time.sleep(3600)
