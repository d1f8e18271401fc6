"""Weight sync: learner weights -> running vLLM rollout engines, without restarting them.

The learner's side, its weights in HF naming and bucketed, is `weights.py`; every learner rank
iterates them (ZeRO-3 gathers are collective), rank 0 (or every rank, colocated) pushes them.

Transports (the table and what each can do: `rlkit.transports`; each class here is its engine
side, `open(target)` then `push(named, defer) -> SyncStats`):
- `ObjectStoreSync`: default on CPU and across nodes. Buckets of <= `bucket_mib` MiB go through the
  Ray object store as one flat buffer each (`FlatBucket`), one bucket at a time (at most
  `max_inflight` in the store), so a large model is never held twice in host memory. Engines
  reload each bucket in place, reading the buffer where the store keeps it.
- `BroadcastSync`: NCCL (HCCL) group between learner rank 0 and all engine workers; a bucket goes
  device to device as one flat buffer, one broadcast. GPU only; needs a GPU check (not runnable
  on CPU).
- `InProcessSync`: learner and engine share a process; the iterator is handed straight to
  the engine's `reload_weights`.
- `AdapterSync` (`rollout.lora_sync: adapter`): the LoRA adapter's files alone, one object in the
  store, loaded by every engine as a new adapter version over the base it started with.

Every engine call of a push waits at most `timeout_s` (`rollout.sync_timeout_s`), then a
`FaultError` names the engine (see `actors/calls.py`).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlkit.actors.calls import wait_all
from rlkit.actors.roles import call
from rlkit.rollout.buckets import FlatBucket, NamedTensor, bucketize
from rlkit.rollout.policy import PendingLoads
from rlkit.rollout.vllm_ext import communicator_class
from rlkit.rollout.worker import RolloutWorker
from rlkit.transports import Transport

# ---------------------------------------------------------------- strategies


@dataclass(frozen=True)
class SyncStats:
    """What one push moved: tensor count, bytes, buckets, wall seconds; and, for a deferred push
    whose loads were left running, those loads (`PendingLoads`, for the caller to wait on)."""

    tensors: int
    bytes: int
    buckets: int
    seconds: float
    pending: PendingLoads | None = None

    def as_dict(self) -> dict[str, Any]:
        """The figures as a dict (what crosses the Ray boundary), `pending` only when set."""
        figures = {"tensors": self.tensors, "bytes": self.bytes, "buckets": self.buckets, "seconds": self.seconds}
        return {**figures, "pending": self.pending} if self.pending is not None else figures


@dataclass(frozen=True)
class SyncTarget:
    """Where a push goes and how: the engines (actor handles; for a colocated transport, the
    `RolloutWorker` in this process), their names in errors, the bucket size, each engine call's
    limit, and this learner's device and collective backend (for a collective transport)."""

    engines: Any
    bucket_mib: float = 256.0
    timeout_s: float | None = None
    names: list[str] | None = None
    device: Any = "cpu"
    backend: str | None = None


def open_transport(transport: Transport, target: SyncTarget) -> Any:
    """The engine side of `transport` (its table row's `build`), opened on `target`."""
    module, _, name = transport.build.partition(":")
    return getattr(importlib.import_module(module), name).open(target)


class _Counter:
    def __init__(self, named: Iterable[NamedTensor]):
        self.named, self.tensors, self.bytes = named, 0, 0

    def __iter__(self) -> Iterator[NamedTensor]:
        for name, tensor in self.named:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class _Engines:
    """Rollout actor handles and the wait on their calls: each call at most `timeout_s` (None: no
    limit), a late engine named by `names` (default: by its index)."""

    def __init__(self, engines: list[Any], timeout_s: float | None, names: list[str] | None = None):
        self.engines, self.timeout_s = list(engines), timeout_s
        self.owners = list(names or [f"engine {i}" for i in range(len(self.engines))])

    def wait(self, futures: list[Any], phase: str = "the weight sync") -> list[Any]:
        return wait_all(futures, self.owners, phase, self.timeout_s)

    def reset_prefix_cache(self) -> None:
        self.wait([call(e, RolloutWorker.reset_prefix_cache) for e in self.engines])


class ObjectStoreSync(_Engines):
    """Ray object store transfer; `engines` are rollout actor handles (`SeparateEngines`).

    Each bucket is `ray.put` once as one flat CPU buffer (optionally cast to `dtype`) and loaded by
    all engines; at most `max_inflight` buckets live in the store at a time. Each engine call may
    take `timeout_s` seconds at most (None: no limit).

    `push(named, defer=True)`: a policy of at most `max_inflight` buckets is put and its loads
    (then the engines' prefix-cache resets) are sent, but not waited for; the stats' `pending` holds
    their futures and the buckets, for the caller to wait on (and to load again into an engine
    restarted meanwhile). A larger policy is waited for as without `defer`. `defer="stage"`: every
    bucket is put and none sent (`pending` holds the buckets alone): each engine loads them itself,
    between two steps of a streaming call (`RolloutWorker.stream`'s `load`).
    """

    def __init__(self, engines: list[Any], bucket_mib: float = 256.0,
                 dtype: torch.dtype | None = None, max_inflight: int = 2, timeout_s: float | None = None,
                 names: list[str] | None = None):
        if not engines:
            raise ValueError("ObjectStoreSync needs at least one rollout engine")
        super().__init__(engines, timeout_s, names)
        self.bucket_mib, self.dtype = bucket_mib, dtype
        self.max_inflight = max(1, max_inflight)

    @classmethod
    def open(cls, target: SyncTarget) -> ObjectStoreSync:
        return cls(target.engines, target.bucket_mib, timeout_s=target.timeout_s, names=target.names)

    def push(self, named: Iterable[NamedTensor], defer: bool | str = False) -> SyncStats:
        import ray

        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        if defer == "stage":
            staged = [ray.put(FlatBucket.pack(b, dtype=self.dtype)) for b in bucketize(counter, self.bucket_mib)]
            return SyncStats(counter.tensors, counter.bytes, len(staged), time.perf_counter() - start,
                             PendingLoads([], [], staged))
        pending: list[list[Any]] = []
        kept: list[Any] | None = [] if defer else None  # the buckets, while the loads may be left running
        for bucket in bucketize(counter, self.bucket_mib):
            ref = ray.put(FlatBucket.pack(bucket, dtype=self.dtype))  # one buffer: one copy, one object
            pending.append([call(e, RolloutWorker.update_weights, ref, reset_cache=False) for e in self.engines])
            if kept is not None:
                kept.append(ref)
                if len(kept) > self.max_inflight:  # too large to leave in the store: wait as usual
                    kept = None
            del ref
            buckets += 1
            while len(pending) >= self.max_inflight + (kept is not None):
                self.wait(pending.pop(0))
        left = None
        if kept is not None:  # each engine resets its cache after its loads (one caller: in order)
            resets = [call(e, RolloutWorker.reset_prefix_cache) for e in self.engines]
            futures = [f for group in pending for f in group] + resets
            left = PendingLoads(futures, list(self.owners) * (len(pending) + 1), kept)
        else:
            for futures in pending:
                self.wait(futures)
            self.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start, left)


class InProcessSync:
    """Colocated learner and engine in one process: the iterator goes straight into vLLM.

    `worker`: a `RolloutWorker` whose engine runs in this process (V1 multiprocessing off), so
    the learner's tensors reach `reload_weights` by reference. Buckets keep fused layers whole.
    """

    def __init__(self, worker: Any, bucket_mib: float = 1024.0):
        self.worker, self.bucket_mib = worker, bucket_mib

    @classmethod
    def open(cls, target: SyncTarget) -> InProcessSync:
        return cls(target.engines)

    def push(self, named: Iterable[NamedTensor], defer: bool = False) -> SyncStats:
        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        for bucket in bucketize(counter, self.bucket_mib):
            self.worker.update_weights(bucket, reset_cache=False)
            buckets += 1
        self.worker.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start)


class AdapterSync(_Engines):
    """The adapter row's engine side: the files of a peft adapter directory (the learner's payload
    for this row), put once in the Ray object store and loaded by every engine as a new adapter
    version (`RolloutWorker.load_adapter`); the engines keep the base weights they started with."""

    @classmethod
    def open(cls, target: SyncTarget) -> AdapterSync:
        return cls(target.engines, target.timeout_s, target.names)

    def push(self, files: dict[str, bytes], defer: bool = False) -> SyncStats:
        import ray

        start, ref = time.perf_counter(), ray.put(files)
        received = self.wait([call(e, RolloutWorker.load_adapter, ref) for e in self.engines])
        return SyncStats(len(files), received[0], 1, time.perf_counter() - start)


class BroadcastSync(_Engines):
    """NCCL/HCCL broadcast from learner rank 0 to every engine worker. GPU only, unverified here.

    `engines`: rollout actor handles with their tensor-parallel sizes. Learner rank 0 joins as
    rank 0 of a group of `1 + sum(tp_sizes)` (`connect`, once), then calls `push` every sync.
    """

    def __init__(self, engines: list[Any], tp_sizes: list[int], master_addr: str,
                 master_port: int, device: torch.device | str, backend: str = "nccl",
                 bucket_mib: float = 256.0, timeout_s: float | None = None):
        super().__init__(engines, timeout_s)
        self.tp_sizes = list(tp_sizes)
        self.addr, self.port, self.device = master_addr, master_port, torch.device(device)
        self.backend, self.bucket_mib, self.comm = backend, bucket_mib, None

    @classmethod
    def open(cls, target: SyncTarget) -> BroadcastSync:
        """Set up the group from this process (learner rank 0) to every worker of the engines."""
        from rlkit.actors.cluster import rendezvous

        engines = list(target.engines)
        address, port = rendezvous()
        tp_sizes = wait_all([call(e, RolloutWorker.tensor_parallel_size) for e in engines],
                            target.names or [f"engine {i}" for i in range(len(engines))], "the broadcast setup",
                            target.timeout_s)
        sync = cls(engines, tp_sizes, address, port, target.device, target.backend or "nccl", target.bucket_mib,
                   target.timeout_s)
        sync.setup()
        return sync

    def setup(self) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        world = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.engines))]
        futures = [call(e, RolloutWorker.init_weight_update_group, self.addr, self.port, off, world, self.backend)
                   for e, off in zip(self.engines, offsets)]
        group = StatelessProcessGroup.create(host=self.addr, port=self.port, rank=0, world_size=world)
        self.comm = communicator_class(self.backend)(group, device=self.device)
        self.wait(futures, "the broadcast setup")

    def push(self, named: Iterable[NamedTensor], defer: bool = False) -> SyncStats:
        if self.comm is None:
            raise RuntimeError("BroadcastSync.setup() must run before push()")
        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        for bucket in bucketize(counter, self.bucket_mib):
            flat = FlatBucket.pack(bucket, self.device)  # one broadcast a bucket, not one a tensor
            futures = [call(e, RolloutWorker.update_weights_broadcast, flat.entries, flat.nbytes) for e in self.engines]
            self.comm.broadcast(flat.data, src=0)
            self.wait(futures)
            buckets += 1
        self.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start)
