"""Rollout engines as a group: where they run, how prompts are split, how weights reach them.

Two placements behind one interface (`RolloutEngines`):
- `SeparateEngines` (default): each vLLM engine in its own Ray actor and placement-group bundle
  (with its tensor-parallel devices), weights pushed by learner rank 0 through the Ray object
  store or an NCCL/HCCL broadcast.
- `ColocatedEngines` (`rollout.colocate`): one engine inside each learner process, weights
  handed over in-process; on accelerators the engines sleep while the learners train.

Prompts are split contiguously over the engines; samples come back prompt-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlkit.accel import DeviceInfo
from rlkit.config import ModelConfig, RayConfig, RolloutConfig
from rlkit.engine.calls import name_actor, wait_all
from rlkit.engine.group import LearnerGroup
from rlkit.engine.rollout import Sample, Sampling
from rlkit.errors import FaultError, UserError
from rlkit.seeding import derive_seed


class RolloutEngines(Protocol):
    """What a driver needs from its rollout engines. Every call waits at most
    `rollout.sync_timeout_s` (`start_timeout_s` for the start), then raises a `FaultError`
    naming the engine and the phase."""

    names: list[str]

    def generate_async(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Any]: ...
    def gather(self, futures: list[Any]) -> list[Sample]: ...
    def generate(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Sample]: ...
    def sync_from(self, learners: LearnerGroup) -> dict[str, float]: ...
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]: ...
    def idle(self) -> None: ...
    def shutdown(self) -> None: ...


def sampling(rollout: RolloutConfig) -> Sampling:
    """The recipe's sampling settings."""
    return Sampling(rollout.temperature, rollout.top_p, rollout.max_tokens, tuple(rollout.stop))


def sync_strategy(rollout: RolloutConfig, device: DeviceInfo) -> str:
    """What `rollout.sync` resolves to on `device`; a user error if it cannot run there."""
    if rollout.sync == "auto":
        return "in_process" if rollout.colocate else "object_store"
    if rollout.sync == "broadcast" and device.weight_sync_backend is None:
        raise UserError(f"rollout.sync: broadcast needs NCCL/HCCL between devices, but rlkit runs on "
                        f"{device.kind}; use sync: object_store (or auto)")
    return rollout.sync


def worker_options(rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, seed: int,
                   adapter: AdapterServing | None = None) -> dict[str, Any]:
    """`RolloutWorker` keyword arguments of one engine, separate or colocated alike."""
    return dict(dtype="float32" if model.dtype == "fp32" else "auto", seed=seed,
                max_model_len=rollout.max_model_len, gpu_memory_utilization=rollout.gpu_memory_utilization,
                kv_cache_gib=None if device.is_accelerator else rollout.kv_cache_gib,
                **({} if adapter is None else {"lora_rank": adapter.rank, "max_loras": adapter.versions}))


@dataclass(frozen=True)
class AdapterServing:
    """`rollout.lora_sync: adapter`: engines serve the base weights plus a LoRA adapter of rank up
    to `rank`. An engine runs its calls in order, so a generation queued before a sync finishes
    with the old adapter before the new one loads; `versions` = 2 keeps the old one registered
    until the new one is in."""

    rank: int
    versions: int = 2


def start_engines(rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, ray_cfg: RayConfig,
                  learners: LearnerGroup, seed: int, adapter: AdapterServing | None = None) -> RolloutEngines:
    """The recipe's engines, loaded from `model.path`, placed as `rollout.colocate` says; with
    `adapter`, each sync sends only the LoRA adapter (separate engines)."""
    if rollout.colocate:
        return ColocatedEngines(learners, rollout, model, device, seed)
    return SeparateEngines(rollout, model, device, ray_cfg, seed, adapter)


def sync_check_tol(rollout: RolloutConfig, model: ModelConfig, quantized_learner: bool = False) -> float:
    """`rollout.sync_check_tol`, or its default: 1e-3 nats for fp32 models (engine and learner
    agree to ~1e-5 on CPU), 0.5 otherwise (half-precision kernels differ; not yet calibrated on
    a GPU), 2.0 when the learner's base is 4-bit and the engines' is not (QLoRA with adapter sync:
    the gap is the quantization, 0.4 nats on the tiny model)."""
    if rollout.sync_check_tol is not None:
        return rollout.sync_check_tol
    if quantized_learner and rollout.lora_sync == "adapter":
        return 2.0
    return 1e-3 if model.dtype == "fp32" else 0.5


def sync_check(engines: RolloutEngines, learners: LearnerGroup, sequences: list[list[int]], tol: float,
               when: str) -> float:
    """Parity probe after a weight sync: the engines and the learner score `sequences` (token
    ids); returns the largest |engine - learner| token logprob over engines and tokens. Above
    `tol` (or NaN) a `FaultError` names the worst engine: its weights are not the learner's."""
    want = torch.tensor([x for seq in learners.sequence_logprobs(sequences) for x in seq])
    diffs = [float((torch.tensor([x for seq in got for x in seq]) - want).abs().max())
             for got in engines.sequence_logprobs(sequences)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] if diffs[i] == diffs[i] else float("inf"))
    if not diffs[worst] <= tol:
        raise FaultError(f"sync check {when}: {engines.names[worst]} scores the check sequences up to "
                         f"{diffs[worst]:.3g} nats away from the learner (rollout.sync_check_tol {tol:g}), so "
                         f"the weight sync did not reach it whole; stopping rather than training on its "
                         f"samples (checkpoints already written are intact)")
    return diffs[worst]


def _shards(prompts: list[str], k: int) -> list[list[str]]:
    size = -(-len(prompts) // k)
    return [prompts[i * size:(i + 1) * size] for i in range(k)]


def _generate_async(handles: list[Any], prompts: list[str], n: int, sampling: Sampling,
                    seed: int) -> list[tuple[int, Any]]:
    """Start `n` samples per prompt on the engines behind `handles` (actor handles with a
    `generate` method); (engine index, Ray future) pairs, in prompt order."""
    return [(i, h.generate.remote(shard, n=n, seed=derive_seed(seed, i), **sampling.kwargs()))
            for i, (h, shard) in enumerate(zip(handles, _shards(prompts, len(handles)))) if shard]


def _gather(futures: list[tuple[int, Any]], names: list[str], timeout_s: float) -> list[Sample]:
    parts = wait_all([f for _, f in futures], [names[i] for i, _ in futures], "the generation", timeout_s)
    return [s for part in parts for s in part]


class SeparateEngines:
    """`rollout.num_engines` engines, each its own actor in its own bundle of `tp` devices (or `tp`
    CPUs: vLLM runs one process per TP rank inside the actor), apart from the learners' bundles."""

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, ray_cfg: RayConfig,
                 seed: int, adapter: AdapterServing | None = None):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.engine.placement import actor_resources, placement_group, worker_env
        from rlkit.engine.rollout import create_rollout_actor

        tp = rollout.tensor_parallel_size
        cpus = ray_cfg.cpus_per_actor * (1 if device.is_accelerator else tp)
        opts = actor_resources(device, cpus, devices=tp)
        resources = {"CPU": opts["num_cpus"], **({"GPU": opts["num_gpus"]} if "num_gpus" in opts else {}),
                     **opts.get("resources", {})}
        self.rollout, self.strategy = rollout, sync_strategy(rollout, device)
        self.timeout, self.adapter = rollout.sync_timeout_s or None, adapter
        self.names = [f"engine {i}" for i in range(rollout.num_engines)]
        self.pg = placement_group(device, rollout.num_engines, cpus, devices=tp)
        self.handles = [
            create_rollout_actor(
                model.path, resources=resources, env_vars=worker_env(device),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
                tensor_parallel_size=tp, index=i,
                **worker_options(rollout, model, device, derive_seed(seed, "engine", i, bits=31), adapter))
            for i in range(rollout.num_engines)]
        for handle, name in zip(self.handles, self.names):
            name_actor(handle, name)
        wait_all([h.ready.remote() for h in self.handles], self.names, "its start",
                 rollout.start_timeout_s or None, knob="rollout.start_timeout_s")

    def generate_async(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Any]:
        """Start generating; returns at once (Ray futures for `gather`)."""
        return _generate_async(self.handles, prompts, n, sampling, seed)

    def gather(self, futures: list[Any]) -> list[Sample]:
        """The samples of `generate_async`, prompt-major."""
        return _gather(futures, self.names, self.timeout)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Sample]:
        """`n` samples per prompt, prompt-major, reproducible for `seed`."""
        return self.gather(self.generate_async(prompts, n, sampling, seed))

    def sync_from(self, learners: LearnerGroup) -> dict[str, float]:
        """The learners' current policy into every engine, in place (no restart)."""
        if self.adapter is not None:
            return self._sync_adapter(learners)
        return learners.push_weights(self.handles, self.rollout.sync_bucket_mib, self.strategy, self.timeout)[0]

    def _sync_adapter(self, learners: LearnerGroup) -> dict[str, float]:
        """Only the LoRA adapter, from learner rank 0 through the object store into every engine."""
        import time

        import ray

        t0 = time.perf_counter()
        files = ray.put(learners.adapter_files(self.timeout))
        sizes = wait_all([h.load_adapter.remote(files) for h in self.handles], self.names, "the adapter sync",
                         self.timeout)
        return {"bytes": sizes[0], "seconds": time.perf_counter() - t0}

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Each engine's `RolloutWorker.sequence_logprobs` (the sync check)."""
        return wait_all([h.sequence_logprobs.remote(sequences) for h in self.handles], self.names,
                        "the sync check", self.timeout)

    def idle(self) -> None:
        """Nothing to free: separate engines keep their memory."""

    def shutdown(self) -> None:
        import ray

        for h in self.handles:
            ray.kill(h)
        ray.util.remove_placement_group(self.pg)


class ColocatedEngines:
    """One engine inside each learner process (`Learner.start_engine`); the learner group owns
    the actors."""

    def __init__(self, learners: LearnerGroup, rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo,
                 seed: int):
        self.learners, self.timeout = learners, rollout.sync_timeout_s or None
        self.names = [f"engine {rank} (in learner {rank})" for rank in range(learners.size)]
        options = [{**worker_options(rollout, model, device, derive_seed(seed, "engine", rank, bits=31)),
                    "index": rank} for rank in range(learners.size)]
        learners.start_engines(model.path, [{**o, "sleep_mode": rollout.sleep} for o in options],
                               rollout.start_timeout_s or None)

    def generate_async(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Any]:
        return _generate_async(self.learners.actors, prompts, n, sampling, seed)

    def gather(self, futures: list[Any]) -> list[Sample]:
        return _gather(futures, self.names, self.timeout)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seed: int) -> list[Sample]:
        return self.gather(self.generate_async(prompts, n, sampling, seed))

    def sync_from(self, learners: LearnerGroup) -> dict[str, float]:
        """Every rank loads its own engine by reference; rank 0's stats."""
        return learners.push_weights_in_process(self.timeout)[0]

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        return self.learners.engine_sequence_logprobs(sequences, self.timeout)

    def idle(self) -> None:
        """Generation is over until the next sync: on accelerators the engines sleep (vLLM sleep
        mode) so the learners get the device memory back."""
        self.learners.sleep_engines()

    def shutdown(self) -> None:
        """Nothing of its own: the engines go with the learner actors."""
