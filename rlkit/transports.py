"""The weight-sync transports a recipe may name (`rollout.sync`): one table of what each can do.

A transport moves the learner's current policy into the rollout engines after an update. The
rest of rlkit asks its row here, never its name: the recipe's allowed values (`RolloutConfig.sync`),
the colocation rule, whether the device can run it, whether an engine restarted mid-run can load
the policy from it again, whether its loads may run on behind the next generation, and where its
engine-side class lives (`build`, imported when a push first needs it: its `open` and `push`, see
`rlkit.engine.weight_sync`). The parity probe after a sync (`rlkit.engine.parity`) is the same for
every transport: it compares what the engines score with what the learner scores.

A new transport is a class with `open` and `push`, a row of this table, and a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlkit.errors import UserError


@dataclass(frozen=True)
class Transport:
    name: str
    build: str  # "module:Class" of the engine side: `Class.open(target)`, then `.push(named, defer)`
    colocated: bool  # the engine lives in the learner's process (rollout.colocate: true), and only there
    collective: bool  # a device collective group (NCCL/HCCL): accelerators only
    rejoinable: bool  # an engine restarted mid-run can load the policy from it (fault tolerance)
    deferrable: bool  # its loads may run on behind the next generation (grpo.max_staleness)
    persistent: bool  # opened once, on the first push, and kept (a connection); else opened per push
    summary: str


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    Transport("object_store", "rlkit.engine.weight_sync:ObjectStoreSync", colocated=False, collective=False,
              rejoinable=True, deferrable=True, persistent=False,
              summary="buckets through the Ray object store; any device, across nodes (the default for "
                      "separate engines)"),
    Transport("broadcast", "rlkit.engine.weight_sync:BroadcastSync", colocated=False, collective=True,
              rejoinable=False, deferrable=False, persistent=True,
              summary="an NCCL/HCCL group from learner rank 0 to every engine worker, device to device"),
    Transport("in_process", "rlkit.engine.weight_sync:InProcessSync", colocated=True, collective=False,
              rejoinable=True, deferrable=False, persistent=False,
              summary="by reference into the engine in the learner's own process (the default when colocated)"),
)}

# what `rollout.sync` may say: "auto" or a row's name
SyncName = Literal[("auto", *TRANSPORTS)]  # type: ignore[valid-type]


def names(**wanted: bool) -> str:
    """The names of the rows with these properties, as a message lists them ("a or b")."""
    return " or ".join(t.name for t in TRANSPORTS.values() if all(getattr(t, k) == v for k, v in wanted.items()))


def colocation_problem(name: str, colocate: bool) -> str | None:
    """Why `rollout.sync: name` does not go with `rollout.colocate` (one line), or None."""
    transport = TRANSPORTS.get(name)
    if transport is None or transport.colocated == colocate:
        return None
    if transport.colocated:
        return f"{name} sync needs colocate: true (the engine must live in the learner process)"
    return f"colocated engines take weights in-process; use sync: auto or {names(colocated=True)}"


def resolve(name: str, colocate: bool, device_kind: str, collective_backend: str | None) -> Transport:
    """The transport `rollout.sync: name` means here ("auto": in_process when colocated, else
    object_store); a `UserError` when this device cannot run it."""
    transport = TRANSPORTS["in_process" if colocate else "object_store"] if name == "auto" else TRANSPORTS[name]
    if transport.collective and collective_backend is None:
        raise UserError(f"{name} needs NCCL/HCCL between devices, but rlkit runs on {device_kind}; use sync: "
                        f"{names(collective=False, colocated=False)} (or auto)", "rollout.sync")
    return transport
