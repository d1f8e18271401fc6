"""Faults on purpose, for the tests that show a fault is caught and reported (not for users).

`RLKIT_FAULT` holds `;`-separated faults; Ray actors inherit it from the driver's environment:
- `sync_skip:<text>[:<engine>]`: rollout engine `<engine>` (every engine if none is named)
  drops the synced tensors whose HF name contains `<text>` (a sync that silently misses one).
- `hang:<phase>:<engine>[:<after>]`: rollout engine `<engine>` sleeps for an hour in its
  `<phase>` call (`generate`, `weight_sync`) after `<after>` such calls went through (default
  0), as a wedged engine would.
- `die:<phase>:<actor>[:<after>]`: the actor (`engine1`, `learner1`) kills its own process with
  SIGKILL in its `<phase>` call (engines: `generate`, `weight_sync`; learners: `fit`,
  `train_step`, `save_checkpoint`) after `<after>` such calls went through (default 0), as an OOM
  kill or a crash would.
- `enospc:<actor>[:<after>]`: the actor's `save_checkpoint` raises "No space left on device".
- `halt:<phase>:<actor>[:<after>]`: the process (`driver`, `learner0`, `engine0`) kills the whole
  run with SIGKILL (the driver's process group, which holds Ray's local services, so the actors
  go too), as a node lost or a job killed without notice would, in its `<phase>`: the actors'
  phases of `die`, and the driver's `step` (the step's metrics are logged) and `checkpoint` (the
  learners' files are written, the manifest is not).
"""

from __future__ import annotations

import collections
import errno
import os
import signal
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


def _due(args: list[str], names: list[str], calls: int) -> bool:
    """Whether a fault's `args` start with `names` and let fewer than `calls` calls through (the
    optional argument after the names; default 0)."""
    return args[:len(names)] == names and calls > int((args[len(names):] or ["0"])[0])


def hang_here(phase: str, engine: int) -> None:
    """Sleep for an hour if a `hang` fault names this phase and engine, and this is a call after
    the ones it lets through."""
    _calls[phase, engine] += 1
    if any(_due(args, [phase, str(engine)], _calls[phase, engine]) for args in _faults("hang")):
        time.sleep(3600)


def crash_here(phase: str, actor: str) -> None:
    """SIGKILL this process (a `die` fault) or the whole run (`halt`) if such a fault names this
    phase and actor ("learner1", "driver") and this is a call after the ones it lets through. The
    run is the driver's process group: the driver's own, an actor's parent's (the local raylet,
    which the driver started)."""
    _calls[phase, actor] += 1
    if any(_due(args, [phase, actor], _calls[phase, actor]) for args in _faults("die")):
        os.kill(os.getpid(), signal.SIGKILL)
    if any(_due(args, [phase, actor], _calls[phase, actor]) for args in _faults("halt")):
        os.killpg(os.getpgrp() if actor == "driver" else os.getpgid(os.getppid()), signal.SIGKILL)


def full_disk_here(actor: str) -> None:
    """Raise ENOSPC if an `enospc` fault names this actor and this is a checkpoint after the ones
    it lets through."""
    _calls["enospc", actor] += 1
    if any(_due(args, [actor], _calls["enospc", actor]) for args in _faults("enospc")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

