"""Weight sync: learner weights -> running vLLM rollout engines, without restarting them.

Learner side: `iter_named_weights(module, zero_stage, lora_merge)` yields `(hf_name, tensor)` in
HF checkpoint naming (ZeRO-3 gathered module by module, LoRA merged). Every learner rank must
iterate it (ZeRO-3 gathers are collective); only rank 0 gets tensors and calls `push`.

Strategies (each `push(named) -> SyncStats`):
- `ObjectStoreSync`: default on CPU and across nodes. Buckets of <= `bucket_mib` MiB go through the
  Ray object store, one bucket at a time (at most `max_inflight` in the store), so a large model
  is never held twice in host memory. Engines reload each bucket in place.
- `BroadcastSync`: NCCL (HCCL) group between learner rank 0 and all engine workers; tensors go
  device to device. GPU only; needs a GPU check (not runnable on CPU).
- `InProcessSync`: learner and engine share a process; the iterator is handed straight to
  the engine's `reload_weights`.

Every engine call of a push waits at most `timeout_s` (`rollout.sync_timeout_s`), then a
`FaultError` names the engine (see `engine/calls.py`).

Buckets never split a transformer layer (`...layers.<i>.`), because vLLM fuses q/k/v and
gate/up into one parameter and processes a layer once all its parts are loaded.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlkit.engine.calls import wait_all
from rlkit.engine.vllm_ext import communicator_class, dtype_name

NamedTensor = tuple[str, torch.Tensor]
_PREFIXES = ("module.", "base_model.model.", "_orig_mod.")
_WRAPPERS = ("DeepSpeedEngine", "PipelineEngine", "DistributedDataParallel")
_LAYER_KEY = re.compile(r"^(.*?\.layers\.\d+)\.")


# ---------------------------------------------------------------- naming and buckets


def hf_name(name: str) -> str:
    """Map a wrapped parameter name (DeepSpeed, peft, torch.compile) to its HF checkpoint name."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def _group_key(name: str) -> str:
    match = _LAYER_KEY.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


def bucketize(named: Iterable[NamedTensor], bucket_mib: float) -> Iterator[list[NamedTensor]]:
    """Group consecutive tensors into buckets of about `bucket_mib` MiB.

    Tensors of one layer group (same `...layers.<i>` prefix, else same module) stay in one
    bucket even if the group alone exceeds the budget.
    """
    budget = bucket_mib * 2**20
    bucket: list[NamedTensor] = []
    group: list[NamedTensor] = []
    size = group_size = 0
    key = None
    for name, tensor in named:
        k = _group_key(name)
        if k != key and group:
            if bucket and size + group_size > budget:
                yield bucket
                bucket, size = [], 0
            bucket, size = bucket + group, size + group_size
            group, group_size = [], 0
        key = k
        group.append((name, tensor))
        group_size += tensor.numel() * tensor.element_size()
    if bucket and size + group_size > budget:
        yield bucket
        bucket = []
    if bucket or group:
        yield bucket + group


# ---------------------------------------------------------------- learner side


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    if weight.__class__.__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(layer).detach()
    return weight.detach()


def _merged_lora(module: nn.Module) -> dict[str, torch.Tensor]:
    """`{"weight": W + sum_a scale_a * B_a @ A_a, "bias": ...}` for one peft LoRA layer,
    computed without touching the module."""
    base = module.get_base_layer()
    weight = _dense_weight(base).clone()
    bias = base.bias.detach().clone() if getattr(base, "bias", None) is not None else None
    if not module.disable_adapters and not module.merged:
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if getattr(module, "lora_variant", {}).get(adapter) is not None:
                raise NotImplementedError(
                    f"weight sync of LoRA variant (DoRA, ...) adapter {adapter!r} is not supported;"
                    " merge the adapter into the model or disable the variant")
            weight += module.get_delta_weight(adapter).to(weight.dtype)
            if getattr(module, "lora_bias", {}).get(adapter) and bias is not None:
                bias += module.lora_B[adapter].bias.detach() * module.scaling[adapter]
    out = {"weight": weight}
    if bias is not None:
        out["bias"] = bias
    return out


def _units(model: nn.Module, lora_merge: bool) -> Iterator[tuple[str, nn.Module, bool]]:
    """(name, module, is_lora_unit) in module order; a LoRA layer is one unit, children skipped."""
    skip: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if skip and name.startswith(skip):
            continue
        if lora_merge and _is_lora_layer(module):
            skip = skip + (name + ".",)
            yield name, module, True
        elif ".original_module" in f".{name}." or ".lora_" in f".{name}":
            continue
        else:
            yield name, module, False


def _gathered(params: list[nn.Parameter]):
    """Gather ZeRO-3 partitioned params for reading (all ranks must enter); else a no-op."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def iter_named_weights(module: nn.Module, zero_stage: int = 0, lora_merge: bool = False,
                       all_ranks: bool = False) -> Iterator[NamedTensor]:
    """Yield `(hf_name, tensor)` for every parameter of `module` in HF checkpoint naming.

    `module`: the model, a DeepSpeed engine (its `.module` is used) or a peft model.
    `zero_stage=3`: parameters are gathered one module at a time
    (`deepspeed.zero.GatheredParameters(params, modifier_rank=None)`); every rank must iterate,
    only rank 0 yields (cloned) tensors. Otherwise tensors are detached views of the live
    parameters, valid until the next optimizer step.
    `lora_merge`: for peft LoRA layers yield `W + scale * B @ A` under the base name and skip
    `lora_` parameters; the model is not modified.
    `all_ranks`: every rank yields (colocated engines, one per rank).
    """
    model = module
    while type(model).__name__ in _WRAPPERS:
        model = model.module
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() and not all_ranks else 0
    gather = zero_stage == 3
    seen: set[int] = set()
    for name, unit, is_lora in _units(model, lora_merge):
        params = list(unit.parameters() if is_lora else unit.parameters(recurse=False))
        if not params:
            continue
        with _gathered(params) if gather else nullcontext():
            if rank != 0:
                continue
            if is_lora:
                items = [(f"{name}.{k}", v) for k, v in _merged_lora(unit).items()]
            else:
                items = []
                for pname, p in unit.named_parameters(recurse=False):
                    if id(p) in seen or "lora_" in pname:
                        continue
                    seen.add(id(p))
                    items.append((f"{name}.{pname}" if name else pname,
                                  p.detach().clone() if gather else p.detach()))
            for full_name, tensor in items:
                yield hf_name(full_name), tensor


# ---------------------------------------------------------------- strategies


@dataclass(frozen=True)
class SyncStats:
    """What one push moved: tensor count, bytes, buckets, wall seconds."""

    tensors: int
    bytes: int
    buckets: int
    seconds: float


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
        self.futures += [engine.update_weights.remote(b, reset_cache=False) for b in self.buckets]
        self.futures.append(engine.reset_prefix_cache.remote())
        self.owners += [name] * (len(self.buckets) + 1)


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
        self.wait([e.reset_prefix_cache.remote() for e in self.engines])


class ObjectStoreSync(_Engines):
    """Ray object store transfer; `engines` are rollout actor handles (`create_rollout_actor`).

    Each bucket is `ray.put` once (on CPU, optionally cast to `dtype`) and loaded by all
    engines; at most `max_inflight` buckets live in the store at a time. Each engine call may
    take `timeout_s` seconds at most (None: no limit).

    `push(named, defer=True)`: a policy of at most `max_inflight` buckets is put and its loads
    (then the engines' prefix-cache resets) are sent, but not waited for; `pending` then holds
    their futures and the buckets, for the caller to wait on (and to load again into an engine
    restarted meanwhile). A larger policy is waited for as without `defer`.
    """

    def __init__(self, engines: list[Any], bucket_mib: float = 256.0,
                 dtype: torch.dtype | None = None, max_inflight: int = 2, timeout_s: float | None = None,
                 names: list[str] | None = None):
        if not engines:
            raise ValueError("ObjectStoreSync needs at least one rollout engine")
        super().__init__(engines, timeout_s, names)
        self.bucket_mib, self.dtype = bucket_mib, dtype
        self.max_inflight = max(1, max_inflight)
        self.pending: PendingLoads | None = None

    def push(self, named: Iterable[NamedTensor], defer: bool = False) -> SyncStats:
        import ray

        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        pending: list[list[Any]] = []
        kept: list[Any] | None = [] if defer else None  # the buckets, while the loads may be left running
        for bucket in bucketize(counter, self.bucket_mib):
            ref = ray.put([(n, self._to_host(t)) for n, t in bucket])
            pending.append([e.update_weights.remote(ref, reset_cache=False) for e in self.engines])
            if kept is not None:
                kept.append(ref)
                if len(kept) > self.max_inflight:  # too large to leave in the store: wait as usual
                    kept = None
            del ref
            buckets += 1
            while len(pending) >= self.max_inflight + (kept is not None):
                self.wait(pending.pop(0))
        if kept is not None:  # each engine resets its cache after its loads (one caller: in order)
            resets = [e.reset_prefix_cache.remote() for e in self.engines]
            futures = [f for group in pending for f in group] + resets
            self.pending = PendingLoads(futures, list(self.owners) * (len(pending) + 1), kept)
        else:
            for futures in pending:
                self.wait(futures)
            self.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor that owns its storage: a view (ZeRO-1/2 keep every parameter as a view of
        one flat buffer) would put the whole buffer into the object store once per tensor."""
        tensor = tensor.detach().to("cpu", dtype=self.dtype or tensor.dtype).contiguous()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        return tensor


class InProcessSync:
    """Colocated learner and engine in one process: the iterator goes straight into vLLM.

    `worker`: a `RolloutWorker` whose engine runs in this process (V1 multiprocessing off), so
    the learner's tensors reach `reload_weights` by reference. Buckets keep fused layers whole.
    """

    def __init__(self, worker: Any, bucket_mib: float = 1024.0):
        self.worker, self.bucket_mib = worker, bucket_mib

    def push(self, named: Iterable[NamedTensor]) -> SyncStats:
        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        for bucket in bucketize(counter, self.bucket_mib):
            self.worker.update_weights(bucket, reset_cache=False)
            buckets += 1
        self.worker.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start)


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
    def connect(cls, engines: list[Any], device: torch.device | str, backend: str,
                bucket_mib: float, timeout_s: float | None = None) -> BroadcastSync:
        """Set up the group from this process (learner rank 0) to every worker of `engines`."""
        from rlkit.engine.cluster import rendezvous

        address, port = rendezvous()
        tp_sizes = wait_all([e.tensor_parallel_size.remote() for e in engines],
                            [f"engine {i}" for i in range(len(engines))], "the broadcast setup", timeout_s)
        sync = cls(engines, tp_sizes, address, port, device, backend, bucket_mib, timeout_s)
        sync.setup()
        return sync

    def setup(self) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        world = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.engines))]
        futures = [e.init_weight_update_group.remote(self.addr, self.port, off, world, self.backend)
                   for e, off in zip(self.engines, offsets)]
        group = StatelessProcessGroup.create(host=self.addr, port=self.port, rank=0, world_size=world)
        self.comm = communicator_class(self.backend)(group, device=self.device)
        self.wait(futures, "the broadcast setup")

    def push(self, named: Iterable[NamedTensor]) -> SyncStats:
        if self.comm is None:
            raise RuntimeError("BroadcastSync.setup() must run before push()")
        start, counter, buckets = time.perf_counter(), _Counter(named), 0
        for bucket in bucketize(counter, self.bucket_mib):
            specs = [(n, dtype_name(t), tuple(t.shape)) for n, t in bucket]
            futures = [e.update_weights_broadcast.remote(specs) for e in self.engines]
            for _, tensor in bucket:
                self.comm.broadcast(tensor.to(self.device).contiguous(), src=0)
            self.wait(futures)
            buckets += 1
        self.reset_prefix_cache()
        return SyncStats(counter.tensors, counter.bytes, buckets, time.perf_counter() - start)
