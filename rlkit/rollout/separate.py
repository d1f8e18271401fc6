"""Separate rollout engines (the default placement): each vLLM engine in its own Ray actor and
placement-group bundle, restarted in place when it dies or hangs (`SeparateEngines`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from rlkit.accel import DeviceInfo
from rlkit.actors.calls import ActorFault, overdue, unwatch_nodes, wait_all, watch_nodes
from rlkit.actors.roles import call
from rlkit.config import ModelConfig, RayConfig
from rlkit.errors import FaultError
from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.generation import (
    AdapterServing,
    EngineCall,
    Prompt,
    gathered_samples,
    start_generation,
    worker_options,
)
from rlkit.rollout.policy import Learners, PendingLoads
from rlkit.rollout.samples import Sample, Sampling
from rlkit.rollout.streaming import GroupRequest, StreamReport
from rlkit.rollout.worker import RolloutWorker
from rlkit.seeding import derive_seed
from rlkit.transports import SyncRequest, Transport, names

log = logging.getLogger("rlkit.engines")
_SHUTDOWN_S = 10.0  # what a separate engine is given to free itself before its actor is killed


class SeparateEngines:
    """`rollout.num_engines` engines, each its own actor in its own bundle of `tp` devices (or `tp`
    CPUs: vLLM runs one process per TP rank inside the actor), apart from the learners' bundles.

    Fault tolerance: an engine that dies or does not answer a call within `rollout.sync_timeout_s`
    is killed, started again in its bundle, given the learners' current policy (none before the
    first sync: it loads the same `model.path`) and sent again the calls it lost; the same seeds
    give the same samples. One warning line says so, `rollout/restarts` counts restarts. After
    `rollout.max_restarts` restarts of one engine, the next fault stops the run."""

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, ray_cfg: RayConfig,
                 seed: int, learners: Learners, transport: Transport, adapter: AdapterServing | None = None):
        from rlkit.actors.cluster import check_nodes_see, pg_nodes
        from rlkit.actors.placement import engine_cpus, placement_group
        from rlkit.actors.roles import Role
        from rlkit.rollout.worker import cpu_engine_env

        tp = rollout.tensor_parallel_size
        cpus = engine_cpus(device, ray_cfg, tp)
        custom = ray_cfg.resources.engine
        self.rollout, self.transport = rollout, transport
        self.timeout, self.learners = rollout.sync_timeout_s or None, learners
        self.before_sync: Callable[[], None] = lambda: None  # what a sync waits for first (multi-turn rollouts)
        self.names = [f"engine {i}" for i in range(rollout.num_engines)]
        self.pg = placement_group(device, rollout.num_engines, cpus, ray_cfg.placement, devices=tp, custom=custom)
        check_nodes_see(pg_nodes(self.pg), "rollout engines", model_path=model.path)
        self.model = model.path
        self.options = [{**worker_options(rollout, model, device, derive_seed(seed, "engine", i, bits=31), adapter),
                         "tensor_parallel_size": tp, "index": i} for i in range(rollout.num_engines)]
        own = {} if device.is_accelerator else cpu_engine_env(rollout.kv_cache_gib)
        self.role = Role.of(RolloutWorker, "engine", device, ray_cfg, devices=tp, cpus=cpus, env=own)
        self.handles = [self._create(i) for i in range(rollout.num_engines)]
        watch_nodes(self.pg, self.names)
        self._started(range(rollout.num_engines), "its start")
        self.synced = False  # whether the engines hold a pushed policy (else model.path's)
        self.restarts, self.recovery_s = [0] * rollout.num_engines, 0.0
        self.lost: set[int] = set()  # engines whose fault ended the run (hung or dead: killed at shutdown, not asked)
        self._pending: PendingLoads | None = None  # a deferred sync's loads (`sync_from`)
        self._settling = threading.Lock()  # multi-turn rollouts start generations from several threads

    def _create(self, i: int) -> Any:
        """Engine `i`'s actor, in bundle `i` (starting; see `_started`)."""
        return self.role.start(self.model, name=self.names[i], group=self.pg, bundle=i, **self.options[i])

    def _started(self, indices: Any, phase: str) -> None:
        """Wait for engines `indices` to be up; their pid and node go to the run log."""
        indices = list(indices)
        where = wait_all([call(self.handles[i], RolloutWorker.where) for i in indices],
                         [self.names[i] for i in indices], phase, self.rollout.start_timeout_s or None,
                         knob="rollout.start_timeout_s")
        for i, (pid, node) in zip(indices, where):
            log.info("%s: pid %d on node %s", self.names[i], pid, node)

    def generate_async(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Any]:
        """Start generating; returns at once (calls for `gather`)."""
        self._settle()
        return start_generation(self.handles, prompts, n, sampling, seed)

    def gather(self, futures: list[Any]) -> list[Sample]:
        """The samples of `generate_async`, prompt-major; the calls of an engine that died or hung
        go again to its restarted self."""
        return gathered_samples(futures, self._results(futures, "the generation"))

    def generate(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Sample]:
        """`n` samples per prompt, prompt-major, reproducible for `seed`."""
        return self.gather(self.generate_async(prompts, n, sampling, seed))

    def stream_async(self, index: int, groups: list[GroupRequest], sampling: dict[str, Any], version: int,
                     budget_s: float, recompute: bool, **extra: Any) -> EngineCall:
        """Engine `index`'s next streaming call (`RolloutWorker.stream`, `extra`: its `load`, `abort`);
        returns at once."""
        self._settle()
        return EngineCall(index, RolloutWorker.stream, (groups, sampling, version, budget_s, recompute),
                          extra).send(self.handles[index])

    def stream_result(self, sent: EngineCall, late: bool = False) -> StreamReport:
        """A streaming call's report; an `ActorFault` if its engine died, or is `late` (past the bound)."""
        if late:
            raise overdue([self.names[sent.index]], "the generation", self.timeout)
        return wait_all([sent.ref], [self.names[sent.index]], "the generation", self.timeout)[0]

    def stream_hold(self, stops: dict[int, list[int]]) -> None:
        """Before a weight sync: each engine stops the groups `stops[i]` and pauses (one dead or hung is
        restarted: it holds no groups, which its next call tells the stream)."""
        calls = [EngineCall(i, RolloutWorker.stream_hold, (keys, True), {}) for i, keys in stops.items()]
        self._results(calls, "the pause before the weight sync")

    def stream_cut(self) -> dict[int, list[tuple[int, list[Sample]]]]:
        """Each engine's groups, stopped, with their samples so far (one dead or hung is restarted: it
        gives none back, and its groups start over from where the stream last had them)."""
        calls = [EngineCall(i, RolloutWorker.stream_cut, (), {}) for i in range(len(self.handles))]
        return dict(enumerate(self._results(calls, "the cut for a checkpoint")))

    def restart(self, fault: ActorFault) -> None:
        """Restart the engines `fault` names, with the current policy (or raise it: see `_recover`)."""
        self._recover(fault, push=True)

    def stage_from(self, learners: Learners) -> dict[str, Any] | None:
        """The learners' current policy put in Ray's object store for the engines to load themselves,
        between two steps of their next streaming call (its `load`): the push's stats, the buckets
        under `staged`. None where the transport cannot (the engines then take a `sync_from`)."""
        if not self.transport.deferrable:
            return None
        self.before_sync()
        self._settle()
        self.learners = learners
        stats = self._push(range(len(self.handles)), defer="stage")
        self.synced = True
        stats["staged"] = stats.pop("pending").buckets
        return stats

    def sync_from(self, learners: Learners, defer: bool = False) -> dict[str, float]:
        """The learners' current policy into every engine, in place (no restart). An engine that
        dies or hangs meanwhile is restarted, and the sync starts over (the others may hold part
        of it). With `defer` (object store, a policy within its in-flight buckets) this returns
        once the learner has put the policy in the store: the engines load it while the learners
        go on, and the next call that uses the engines waits for the loads first (`_settle`)."""
        self.before_sync()
        self._settle()
        self.learners = learners
        while True:
            try:
                stats = self._push(range(len(self.handles)), defer)
                self.synced = True
                self._pending = stats.pop("pending", None)
                return stats
            except ActorFault as fault:
                self._recover(fault, push=False)

    def _settle(self) -> None:
        """Wait for the loads of a deferred sync. An engine that died or hung in them is restarted
        and loads the same buckets (the learners may have trained on since)."""
        with self._settling:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            while True:
                try:
                    wait_all(pending.futures, pending.owners, "the weight sync", self.timeout)
                    return
                except ActorFault as fault:
                    self._recover(fault, push=False)
                    pending.without(fault.who)
                    for handle, name in zip(self.handles, self.names):
                        if name in fault.who:
                            pending.load_into(handle, name)

    def _push(self, indices: Any, defer: bool | str = False) -> dict[str, Any]:
        """The current policy (or adapter: the row's payload) into engines `indices`; the push's
        stats (with `defer`, maybe the loads left running: `pending`)."""
        indices = list(indices)
        request = SyncRequest(self.transport, [self.handles[i] for i in indices], [self.names[i] for i in indices],
                              self.rollout.sync_bucket_mib, self.timeout, defer)
        return self.learners.push_weights(request)[0]

    def sequence_logprobs(self, sequences: list[Any]) -> list[list[list[float]]]:
        """Each engine's `RolloutWorker.sequence_logprobs` (the sync check)."""
        self._settle()
        calls = [EngineCall(i, RolloutWorker.sequence_logprobs, (sequences,), {}).send(h)
                 for i, h in enumerate(self.handles)]
        return self._results(calls, "the sync check")

    def _results(self, calls: list[EngineCall], phase: str) -> list[Any]:
        """The results of `calls`, in order. A call lost with an engine that was restarted since
        (by this wait or another) is sent again to the new one."""
        while True:
            for c in calls:
                if c.handle is not self.handles[c.index]:
                    c.send(self.handles[c.index])
            try:
                return wait_all([c.ref for c in calls], [self.names[c.index] for c in calls], phase, self.timeout)
            except ActorFault as fault:
                self._recover(fault, push=True)

    def _recover(self, fault: ActorFault, push: bool) -> None:
        """Restart the engines `fault` is about; with `push`, give them the current policy. A fault
        about no engine of this group, under a transport an engine cannot rejoin, or about an engine out of restarts
        is raised (it ends the run)."""
        import time

        import ray

        t0 = time.perf_counter()
        while True:
            bad = [self.names.index(w) for w in fault.who if w in self.names]
            if not bad:
                raise fault
            spent = [i for i in bad if self.restarts[i] >= self.rollout.max_restarts]
            if spent or not self.transport.rejoinable:
                self.lost.update(bad)  # the run ends here: not asked to free itself at shutdown
            if spent:
                n = self.restarts[spent[0]]
                raise FaultError(f"{fault}; it was restarted {n} time{'s' * (n != 1)} already "
                                 f"(rollout.max_restarts {self.rollout.max_restarts})") from fault
            if not self.transport.rejoinable:
                raise FaultError(f"{fault}; a restarted engine cannot rejoin the weight sync, so engines are "
                                 f"not restarted with rollout.sync: {self.transport.name} "
                                 f"({names(rejoinable=True, colocated=False, payload='weights')} restarts "
                                 "them)") from fault
            try:
                for i in bad:
                    ray.kill(self.handles[i], no_restart=True)
                    self.handles[i] = self._create(i)
                    self.restarts[i] += 1
                self._started(bad, "its restart")
                if push and self.synced:
                    self._push(bad)
                    if self._pending is not None:  # a deferred sync's loads into the replaced engines: superseded
                        self._pending.without(self.names[i] for i in bad)
                break
            except ActorFault as again:  # it died or hung again before it was back
                fault = again
        seconds = time.perf_counter() - t0
        self.recovery_s += seconds
        done = ("restarted and re-synced in {:.1f} s" if push and self.synced else
                "restarted in {:.1f} s (no sync yet: it loads model.path, the policy so far)" if push else
                "restarted in {:.1f} s; the weight sync starts over").format(seconds)
        log.warning("%s; %s (restart %s of rollout.max_restarts %d)", fault, done,
                    ", ".join(str(self.restarts[i]) for i in bad), self.rollout.max_restarts)

    def recovery(self) -> dict[str, float]:
        """`rollout/restarts` (engine restarts so far in this process) and `time/engine_recovery`
        (seconds they took)."""
        return {"rollout/restarts": float(sum(self.restarts)), "time/engine_recovery": self.recovery_s}

    def memory(self) -> list[dict[str, dict[str, int]]]:
        """Each engine's process memory before its engine was built and now."""
        import ray

        self._settle()
        return ray.get([call(h, RolloutWorker.memory) for h in self.handles], timeout=60)

    def idle(self) -> None:
        """Nothing to free: separate engines keep their memory."""

    def shutdown(self) -> None:
        """Each engine frees itself first (its LoRA adapters' files: before, every adapter-synced run
        left its last `max_loras` of them in the engines' temporary folder), then its actor goes. An
        engine whose fault ended the run is not asked: a hung one would only answer after its bound."""
        import ray

        unwatch_nodes(self.names)
        freed = [call(h, RolloutWorker.shutdown, True) for i, h in enumerate(self.handles) if i not in self.lost]
        with contextlib.suppress(Exception):  # a dead or hung engine is killed below all the same
            ray.wait(freed, num_returns=len(freed), timeout=_SHUTDOWN_S)
        for h in self.handles:
            ray.kill(h)
        ray.util.remove_placement_group(self.pg)
