"""Streaming groups with partial rollouts (`grpo.streaming`): the separate engines generate without
pause from a queue of prompts, each group is scored as soon as its samples are done, and a step trains
on the first `prompts_per_step` groups done. New weights load between two of an engine's steps while
its samples run (`rollout/streaming.py`), so each token carries the policy version that sampled it.

Staleness, K = `grpo.max_staleness`: a group trained at step s whose oldest token came from version
v has lag s - v, at most K. Prompts are admitted so that FIFO training keeps to it (the n-th group
kept is admitted once n < (version + K + 1) x prompts_per_step, as AReaL bounds its rollouts); a
group that finishes too late is not trained, and one still running that can no longer make it is
stopped at the sync (both counted in `stream/dropped_stale`). `grpo.max_interruptions` bounds the
weight loads a sample spans: past it the group is dropped or finished, as `grpo.over_interrupted` says.

Each engine has up to two streaming calls in flight (the second waits in its actor's queue), so it
steps on while the driver takes the first one's groups and scores them. A sync over the object store
puts the policy there and queues its load at the head of each engine's next call: the learners do not
wait for the engines, and the engines load between two steps, with no pause. Other transports pause
the engines for the sync.

A checkpoint cuts the groups in the engines where they are (`EngineStream.cut`) and keeps their
samples so far with their tokens' versions; they go on from there, in the run that wrote it as in one
resumed from it, as does a group whose engine died after the cut.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

from rlkit.actors.calls import ActorFault
from rlkit.grpo.advantages import zero_std_mask
from rlkit.grpo.experience import Experience, Generation, completion_metrics, rollout_of, score_samples
from rlkit.grpo.stream_state import StreamGroup, kept, lags, mean_of
from rlkit.rollout.streaming import GroupRequest
from rlkit.seeding import derive_seed

if TYPE_CHECKING:
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.task import Task
    from rlkit.rollout.samples import Sampling

BUDGET_S = 0.05  # an engine's stepping per call: the driver's turn comes this often
DEPTH = 2  # streaming calls in flight per engine


class GroupStream:
    """The driver's side of streaming: admission, the engines' calls in flight, scoring as groups
    come, the staleness bound, and the syncs between."""

    def __init__(self, task: Task, engines: Any, sampler: Any, sampling: Sampling, algo: GRPOAlgoConfig,
                 seed: int, version: int, max_tokens: int):
        self.task, self.engines, self.sampler, self.algo = task, engines, sampler, algo
        self.sampling, self.seed, self.version, self.max_tokens = sampling.kwargs(), seed, version, max_tokens
        self.waiting: collections.deque[StreamGroup] = collections.deque()  # admitted, not sent
        self.running: dict[int, StreamGroup] = {}
        self.done: list[StreamGroup] = []  # scored, in the order they finished
        # engine index -> its calls in flight, oldest first: (call, its number, since when it is the oldest)
        self.calls: dict[int, collections.deque[list[Any]]] = collections.defaultdict(collections.deque)
        self.admitted = self.discarded = self.keys = self.sent = 0
        self.counts = collections.Counter()
        self.busy = collections.Counter()  # engine index -> seconds stepping, since the last step's metrics
        self.tokens, self.paused, self.weights, self.scoring = 0, False, [], 0.0
        self.since = time.perf_counter()  # the last step's take: the window of its metrics

    # ------------------------------------------------------------------ the pump

    def _admit(self) -> None:
        """Draw batches of prompts while FIFO training keeps them within the staleness bound and the
        groups in the engines within `max_running_groups` (more would slow every sample down)."""
        P, K = self.algo.prompts_per_step, self.algo.max_staleness
        cap = self.algo.max_running_groups or 2 * P
        while self.admitted - self.discarded + P <= (self.version + K + 1) * P and \
                len(self.waiting) + len(self.running) + P <= max(cap, P):
            for index in self.sampler.next_batch():
                self.waiting.append(StreamGroup(self.keys, index, derive_seed(self.seed, "stream", self.keys)))
                self.keys += 1
            self.admitted += P

    def _dispatch(self) -> None:
        """Each engine with fewer than `DEPTH` calls in flight gets its next: new groups (to the least
        loaded ones), or none where it has groups running."""
        if self.paused:
            return
        load = collections.Counter(g.engine for g in self.running.values())
        new: dict[int, list[StreamGroup]] = collections.defaultdict(list)
        free = [i for i in range(len(self.engines.names)) if len(self.calls[i]) < DEPTH]
        while self.waiting and free:
            i = min(free, key=lambda e: (load[e], e))
            group = self.waiting.popleft()
            group.engine = i
            group.started = self.version if group.started < 0 else group.started
            self.running[group.key] = group
            new[i].append(group)
            load[i] += 1
        for i in free:
            while len(self.calls[i]) < DEPTH and (new[i] or load[i]):
                groups = new.pop(i, [])
                for g in groups:
                    g.call = self.sent + 1  # (the number `_send` gives the call)
                self._send(i, [self._request(g) for g in groups])

    def _send(self, engine: int, requests: list[GroupRequest], **extra: Any) -> None:
        self.sent += 1
        sent = self.engines.stream_async(engine, requests, self.sampling, self.version, BUDGET_S,
                                         self.algo.partial_kv == "recompute", **extra)
        self.calls[engine].append([sent, self.sent, time.monotonic()])

    def _request(self, group: StreamGroup) -> GroupRequest:
        row = self.task.rows[group.index]
        return GroupRequest(group.key, self.task.engine_prompts([row], [self.task.render(row)])[0],
                            self.algo.group_size, group.seed, start=tuple(group.start or ()))

    def pump(self, until: Any = None, also: list[Any] = ()) -> None:
        """Keep the engines busy and take what they give until `until()` holds (`also`: other refs
        whose readiness may make it hold, waited on beside the engines')."""
        import ray

        while until is None or not until():
            self._admit()
            self._dispatch()
            refs = {q[0][0].ref: i for i, q in self.calls.items() if q}  # each engine's oldest call
            if not refs and until is None:
                return
            if not refs and not also:
                raise RuntimeError("the stream has nothing to generate and nothing to wait for")
            ready, _ = ray.wait([*refs, *also], num_returns=1, timeout=1.0)
            for engine in {refs[ref] for ref in ready if ref in refs}:
                self._receive(engine)
            for engine in [i for i, q in self.calls.items() if q and self.engines.timeout and
                           time.monotonic() - q[0][2] > self.engines.timeout]:
                self._receive(engine, late=True)  # hung: restarted

    def _receive(self, engine: int, late: bool = False) -> None:
        """An engine's oldest call came back: its groups done go to scoring; a dead or hung (`late`)
        engine is restarted (its other calls are lost with it) and its groups start again."""
        queue = self.calls[engine]
        sent, number, _ = queue.popleft()
        try:
            report = self.engines.stream_result(sent, late)
        except ActorFault as fault:
            dead = [c for c in queue if c[0].handle is sent.handle]  # lost with it (not the ones to a new one)
            for c in dead:
                queue.remove(c)
            if sent.handle is self.engines.handles[engine]:  # (not restarted since, by another call)
                self.engines.restart(fault)
            self._lost(engine, max([number] + [c[1] for c in dead]))
            return
        if queue:
            queue[0][2] = time.monotonic()  # the next call's turn starts now
        self.busy[engine] += report.seconds
        finished = []
        for key, samples in report.groups:
            group = self.running.pop(key, None)
            if group is not None:
                group.samples = samples
                finished.append(group)
        self.counts["stream/continued"] += sum(bool(g.start) for g in finished)
        if not report.running:  # it holds none: any sent to it by then were lost (a restart behind a sync)
            self._lost(engine, number)
        self._dispatch()  # the engine's next call before scoring: it does not wait on the rewards
        if finished:
            self.score(finished)

    def _lost(self, engine: int, by: float = float("inf")) -> None:
        """Groups of a restarted engine (by this stream, the pause or the sync) sent by call `by` or
        before: generated again from their start (or from the last checkpoint's cut), by the policy it
        now holds."""
        lost = [g for g in self.running.values() if g.engine == engine and g.call <= by]
        for g in reversed(lost):
            del self.running[g.key]
            g.engine = None
            if not g.start:
                g.started, g.loads = -1, 0
            self.waiting.appendleft(g)
        self.counts["stream/regenerated"] += len(lost)

    def score(self, groups: list[StreamGroup]) -> None:
        rows = [self.task.rows[g.index] for g in groups]
        samples = [s for g in groups for s in g.samples]
        batch = Generation(rows, [self.task.render(r) for r in rows], [], self.engines, time.perf_counter(),
                           samples=samples, indices=[g.index for g in groups])
        t0 = time.perf_counter()
        rewards, per_fn, weights, metrics = score_samples(batch, samples, self.task.scorer, self.algo,
                                                          self.max_tokens)
        self.scoring += time.perf_counter() - t0
        G = self.algo.group_size
        self.weights = weights
        for i, g in enumerate(groups):
            g.rewards, g.per_fn, g.metrics = rewards[i * G:(i + 1) * G], per_fn[i * G:(i + 1) * G], metrics
            self.tokens += sum(len(s.token_ids) for s in g.samples)
        self.done.extend(groups)

    # ------------------------------------------------------------------ steps and syncs

    def take(self, step: int) -> Experience:
        """The first `prompts_per_step` groups done that step `step` may train on (their oldest token at
        most K versions old; with dynamic sampling, not all-equal ones while refills are left)."""
        P, K, G = self.algo.prompts_per_step, self.algo.max_staleness, self.algo.group_size
        chosen: list[StreamGroup] = []
        spare: list[StreamGroup] = []
        scored: list[tuple[int, list[float]]] = []
        refills = self.algo.max_refill_rounds * P if self.algo.dynamic_sampling else 0

        def enough() -> bool:
            while self.done and len(chosen) < P:
                group = self.done.pop(0)
                scored.append((group.index, group.rewards.tolist()))
                if step - group.oldest > K:
                    self._discard("stream/dropped_stale")
                elif self.algo.dynamic_sampling and bool(zero_std_mask(group.rewards, G)[0]) and \
                        len(spare) < refills:
                    spare.append(group)
                    self._discard("dynamic_sampling/filtered")
                else:
                    chosen.append(group)
            return len(chosen) >= P

        t0 = time.perf_counter()
        self.pump(enough)
        exp = self._experience(chosen, scored, step)
        exp.metrics["time/generate"] = time.perf_counter() - t0  # the step's wait for its groups
        return exp

    experience = take  # (the step-level source's name)

    def _discard(self, reason: str) -> None:
        self.discarded += 1
        self.counts[reason] += 1

    def _experience(self, groups: list[StreamGroup], scored: list[tuple[int, list[float]]], step: int) -> Experience:
        exp = Experience(weights=self.weights, groups=scored)
        for g in groups:
            row = self.task.rows[g.index]
            shown = self.task.render(row)
            images = tuple(row.get("images") or ())
            for s in g.samples:
                exp.rollouts.append(rollout_of(s, g.oldest, images))
                exp.texts.append((shown, s.text))
            exp.rewards.extend(g.rewards.tolist())
            exp.per_fn.extend(g.per_fn.tolist())
        lengths = completion_metrics([s for g in groups for s in g.samples])
        lengths.pop("completion/tokens")
        exp.metrics = {**mean_of([g.metrics for g in groups]), **lags(exp.rollouts, step),
                       **{k: float(v) for k, v in self.counts.items()}, **lengths,
                       "stream/running": float(len(self.running)), "stream/done_waiting": float(len(self.done)),
                       "stream/overtook": float(sum(g.key > min(self.running, default=g.key) for g in groups)),
                       "rollout/tokens_per_s": self.tokens / max(1e-9, time.perf_counter() - self.since),
                       "reward/frac_zero_std": sum(bool(zero_std_mask(g.rewards, len(g.rewards))[0]) for g in groups)
                       / len(groups), "time/reward": self.scoring}
        exp.engine_seconds, self.since, self.tokens, self.scoring = dict(self.busy), time.perf_counter(), 0, 0.0
        self.busy.clear()
        return exp

    def _stops(self) -> dict[int, list[int]]:
        """At a sync, the running groups to stop on each engine: the ones that can no longer train
        within the bound, or past their interruptions (dropped, or counted where they finish)."""
        K, stop = self.algo.max_staleness, collections.defaultdict(list)
        for g in list(self.running.values()):
            over = self.algo.max_interruptions is not None and g.loads + 1 > self.algo.max_interruptions
            if self.version + 1 - g.started > K or (over and self.algo.over_interrupted == "drop"):
                stop[g.engine].append(g.key)
                del self.running[g.key]
                self._discard("stream/dropped_stale" if self.version + 1 - g.started > K else
                              "stream/dropped_interrupted")
            elif over:
                self.counts["stream/over_interrupted"] += 1
        return {i: stop[i] for i in range(len(self.engines.names))}

    def _settle(self) -> None:
        """No new calls; the calls in flight come back."""
        self.paused = True
        self.pump(lambda: not any(self.calls.values()))

    def resume(self, version: int) -> None:
        """After the sync: the engines hold `version` (or load it first); the running samples go on under it."""
        for g in self.running.values():
            g.loads += 1
        self.version, self.paused = version, False
        self.counts["stream/interrupted"] += len(self.running)
        self._admit()  # (the new version admits more)
        self._dispatch()

    def during(self, training: Any, step: int) -> list[Any]:
        """The engines go on while the learners train; the training's results."""
        self.pump(training.done, also=training.refs)
        return training()

    def sync(self, learners: Any, version: int) -> dict[str, float]:
        """The policy `version` into the engines, between two of their steps; the sync's stats. Put in
        the object store, it loads at the head of each engine's next call (queued behind the ones in
        flight); over other transports the engines pause, load, and resume."""
        stats = self.engines.stage_from(learners)
        if stats is None:
            self._settle()
            self.engines.stream_hold(self._stops())
            stats = self.engines.sync_from(learners)
        else:
            staged, stops = stats.pop("staged"), self._stops()
            self.version = version  # (the calls carry it)
            for i, keys in stops.items():
                self._send(i, [], load=staged, abort=keys)
        self.resume(version)
        return stats

    def payload(self) -> dict[str, Any]:
        """What a checkpoint keeps (`stream_state.kept`), with the groups in the engines cut where they
        are: they go on from there, in this run as in one resumed from the checkpoint."""
        self._settle()
        cut = {key: samples for groups in self.engines.stream_cut().values() for key, samples in groups}
        finished = []
        for g in sorted(self.running.values(), key=lambda g: g.key, reverse=True):
            got = cut.get(g.key)  # (none from an engine restarted meanwhile)
            if got and all(s.finish_reason for s in got):  # done (beside a held-out eval), not yet given back
                g.samples = got
                finished.append(g)
            else:
                g.start, g.engine = got or g.start, None
                self.waiting.appendleft(g)
        self.counts["stream/cut"] += len(cut) - len(finished)
        self.running.clear()
        self.paused = False
        if finished:
            self.score(finished[::-1])
        state = kept(self)
        self._dispatch()
        return {"stream": state}
