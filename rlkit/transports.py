"""The weight-sync transports a recipe may name (`rollout.sync`): one table of what each can do.

A transport moves the learner's current policy into the rollout engines after an update: every
weight (LoRA merged), or the LoRA adapter alone to engines that serve the base with vLLM's LoRA
(`rollout.lora_sync: adapter`, the row whose payload is the adapter). The rest of rlkit asks its
row here, never its name: the recipe's allowed values (`RolloutConfig.sync`), the colocation and
payload rules, whether the device can run it, whether an engine restarted mid-run can load the
policy from it again, whether its loads may run on behind the next generation, what it moves, and
where its engine-side class lives (`build`, imported when a push first needs it: its `open` and
`push`, see `rlkit.sync.weight_sync`). The row is resolved once, before launch (`resolve`), and
itself crosses to the learners inside each push's `SyncRequest`. The parity probe after a sync
(`rlkit.grpo.parity`) is the same for every transport: it compares what the engines score with
what the learner scores.

A new transport is a class with `open` and `push`, a row of this table, and a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rlkit.errors import UserError


@dataclass(frozen=True)
class Payload:
    """What a push moves: every weight of the policy, LoRA merged (`adapter` False), or the LoRA adapter's
    files alone, to engines that serve the base of model.path with vLLM's LoRA (`adapter` True: the
    learner sends its adapter's files, the engines start serving adapters and keep that base, so a
    4-bit learner's base differs from theirs)."""

    name: str
    adapter: bool


WEIGHTS, ADAPTER = Payload("weights", adapter=False), Payload("adapter", adapter=True)


@dataclass(frozen=True)
class Transport:
    name: str
    build: str  # "module:Class" of the engine side: `Class.open(target)`, then `.push(named, defer)`
    colocated: bool  # the engine lives in the learner's process (rollout.colocate: true), and only there
    collective: bool  # a device collective group (NCCL/HCCL): accelerators only
    rejoinable: bool  # an engine restarted mid-run can load the policy from it (fault tolerance)
    deferrable: bool  # its loads may run on behind the next generation (grpo.max_staleness)
    persistent: bool  # opened once, on the first push, and kept (a connection); else opened per push
    payload: Payload  # what a push moves
    summary: str


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    Transport("object_store", "rlkit.sync.weight_sync:ObjectStoreSync", colocated=False, collective=False,
              rejoinable=True, deferrable=True, persistent=False, payload=WEIGHTS,
              summary="buckets through the Ray object store; any device, across nodes (the default for "
                      "separate engines)"),
    Transport("broadcast", "rlkit.sync.weight_sync:BroadcastSync", colocated=False, collective=True,
              rejoinable=False, deferrable=False, persistent=True, payload=WEIGHTS,
              summary="an NCCL/HCCL group from learner rank 0 to every engine worker, device to device"),
    Transport("in_process", "rlkit.sync.weight_sync:InProcessSync", colocated=True, collective=False,
              rejoinable=True, deferrable=False, persistent=False, payload=WEIGHTS,
              summary="by reference into the engine in the learner's own process (the default when colocated)"),
    Transport("adapter", "rlkit.sync.weight_sync:AdapterSync", colocated=False, collective=False,
              rejoinable=True, deferrable=False, persistent=False, payload=ADAPTER,
              summary="the LoRA adapter alone through the Ray object store, to separate engines that serve the "
                      "base with vLLM's LoRA (rollout.lora_sync: adapter)"),
)}
PAYLOADS = {"merged": WEIGHTS, "adapter": ADAPTER}  # rollout.lora_sync -> what each push moves

# what `rollout.sync` may say: "auto" or the name of a row that moves the weights (the payload is
# `rollout.lora_sync`'s: `LoraSync`)
SyncName = Literal[("auto", *(t.name for t in TRANSPORTS.values() if not t.payload.adapter))]  # type: ignore[valid-type]
LoraSync = Literal[tuple(PAYLOADS)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class SyncRequest:
    """One push as the driver asks it of the learners: the transport's row; the engines (actor
    handles; none for a colocated row, whose engines live in the learners) and their names in
    errors; the bucket size; each engine call's limit; whether its loads may be left running
    (honoured by a deferrable row), or "stage": the policy put for the engines to load themselves."""

    transport: Transport
    engines: Any = None
    names: list[str] | None = None
    bucket_mib: float = 256.0
    timeout_s: float | None = None
    defer: bool | str = False


def names(**wanted: bool | str) -> str:
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


def payload_row(lora_sync: str) -> Transport | None:
    """The one row that moves `rollout.lora_sync`'s payload when it is not the weights (the
    adapter's), or None: the weights go by `rollout.sync`'s row."""
    payload = PAYLOADS[lora_sync]
    return next(t for t in TRANSPORTS.values() if t.payload is payload) if payload.adapter else None


def payload_problem(name: str, colocate: bool, lora_sync: str) -> tuple[str, str] | None:
    """Why no row moves `rollout.lora_sync`'s payload with `rollout.sync: name` and
    `rollout.colocate`: (the rollout key to name, one line), or None."""
    row = payload_row(lora_sync)
    if row is None:
        return None
    if row.colocated != colocate:
        return ("lora_sync", f"{lora_sync} sync runs with {'colocated' if row.colocated else 'separate'} engines "
                             f"for now; use merged with colocate: {str(colocate).lower()}")
    named = TRANSPORTS.get(name)
    if named is not None and (named.colocated, named.collective) != (row.colocated, row.collective):
        return "sync", f"with lora_sync: {lora_sync}, the sync is {row.summary}: use sync: auto"
    return None


def resolve(name: str, colocate: bool, device_kind: str, collective_backend: str | None,
            lora_sync: str = "merged") -> Transport:
    """The transport `rollout.sync: name` means here for `rollout.lora_sync`'s payload ("auto":
    in_process when colocated, else object_store; an adapter goes by the adapter row); a
    `UserError` when this device cannot run it."""
    transport = payload_row(lora_sync)  # an adapter's one row (colocate checked at load: `payload_problem`)
    if transport is None:
        transport = TRANSPORTS[("in_process" if colocate else "object_store") if name == "auto" else name]
    if transport.collective and collective_backend is None:
        raise UserError(f"{name} needs NCCL/HCCL between devices, but rlkit runs on {device_kind}; use sync: "
                        f"{names(collective=False, colocated=False, payload='weights')} (or auto)", "rollout.sync")
    return transport
