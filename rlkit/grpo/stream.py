"""Streaming groups with partial rollouts (`grpo.streaming`): the separate engines generate without
pause from a queue of prompts, each group is scored as soon as its samples are done, and a step trains
on the first `prompts_per_step` groups done. New weights load between two of an engine's steps while
its samples run (`engine/streaming.py`), so each token carries the policy version that sampled it.

Staleness, K = `grpo.max_staleness`: a group trained at step s whose oldest token came from version
v has lag s - v, at most K. Prompts are admitted so that FIFO training keeps to it (the n-th group
kept is admitted once n < (version + K + 1) x prompts_per_step, as AReaL bounds its rollouts); a
group that finishes too late is not trained, and one still running that can no longer make it is
stopped at the sync (both counted in `stream/dropped_stale`). `grpo.max_interruptions` bounds the
weight loads a sample spans: past it the group is dropped or finished, as `grpo.over_interrupted` says.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlkit.engine.calls import ActorFault
from rlkit.engine.streaming import GroupRequest
from rlkit.grpo.advantages import zero_std_mask
from rlkit.grpo.batch import Rollout
from rlkit.grpo.experience import Experience, Generation, completion_metrics, rollout_of, score_samples
from rlkit.seeding import derive_seed

if TYPE_CHECKING:
    from rlkit.engine.samples import Sample, Sampling
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.task import Task

BUDGET_S = 0.05  # an engine's stepping per call: the driver's turn comes this often


@dataclass
class StreamGroup:
    """One prompt's group on its way: admitted, sent to an engine, done, scored."""

    key: int
    index: int  # the row's index in the task's train rows
    seed: int
    started: int = -1  # the policy version of its first token (-1: not sent yet)
    engine: int | None = None
    loads: int = 0  # weight loads it ran across
    samples: list[Sample] | None = None
    rewards: Any = None  # [G] totals, [G, K] per function, the scoring batch's metrics
    per_fn: Any = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def oldest(self) -> int:
        """The version of its oldest token."""
        return min((v for s in self.samples or () for v in (s.versions or ())), default=self.started)


class GroupStream:
    """The driver's side of streaming: admission, one call in flight per engine, scoring as groups
    come, the staleness bound, and the syncs between."""

    def __init__(self, task: Task, engines: Any, sampler: Any, sampling: Sampling, algo: GRPOAlgoConfig,
                 seed: int, version: int, max_tokens: int):
        self.task, self.engines, self.sampler, self.algo = task, engines, sampler, algo
        self.sampling, self.seed, self.version, self.max_tokens = sampling.kwargs(), seed, version, max_tokens
        self.waiting: collections.deque[StreamGroup] = collections.deque()  # admitted, not sent
        self.running: dict[int, StreamGroup] = {}
        self.done: list[StreamGroup] = []  # scored, in the order they finished
        self.calls: dict[int, Any] = {}  # engine index -> its call in flight
        self.sent: dict[int, float] = {}  # engine index -> when its call went
        self.admitted = self.discarded = self.keys = 0
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
        """Each engine without a call in flight gets its next: new groups (to the least loaded ones)."""
        if self.paused:
            return
        load = collections.Counter(g.engine for g in self.running.values())
        new: dict[int, list[StreamGroup]] = collections.defaultdict(list)
        free = [i for i in range(len(self.engines.names)) if i not in self.calls]
        while self.waiting and free:
            i = min(free, key=lambda e: (load[e], e))
            group = self.waiting.popleft()
            group.engine, group.started = i, self.version
            self.running[group.key] = group
            new[i].append(group)
            load[i] += 1
        for i in free:
            if new[i] or load[i]:
                requests = [self._request(g) for g in new[i]]
                self.calls[i] = self.engines.stream_async(i, requests, self.sampling, self.version, BUDGET_S,
                                                          self.algo.partial_kv == "recompute")
                self.sent[i] = time.monotonic()

    def _request(self, group: StreamGroup) -> GroupRequest:
        row = self.task.rows[group.index]
        return GroupRequest(group.key, self.task.engine_prompts([row], [self.task.render(row)])[0],
                            self.algo.group_size, group.seed)

    def pump(self, until: Any = None, also: list[Any] = ()) -> None:
        """Keep the engines busy and take what they give until `until()` holds (`also`: other refs
        whose readiness may make it hold, waited on beside the engines')."""
        import ray

        while until is None or not until():
            self._admit()
            self._dispatch()
            refs = {c.ref: i for i, c in self.calls.items()}
            if not refs and until is None:
                return
            if not refs and not also:
                raise RuntimeError("the stream has nothing to generate and nothing to wait for")
            ready, _ = ray.wait([*refs, *also], num_returns=1, timeout=1.0)
            for engine in {refs[ref] for ref in ready if ref in refs}:
                self._receive(engine)
            for engine in [i for i in self.calls if self.engines.timeout and
                           time.monotonic() - self.sent[i] > self.engines.timeout]:
                self._receive(engine, late=True)  # hung: restarted

    def _receive(self, engine: int, late: bool = False) -> None:
        """An engine's call came back: its groups done go to scoring; a dead or hung (`late`) engine is
        restarted and its groups start again."""
        call = self.calls.pop(engine)
        try:
            report = self.engines.stream_result(call, late)
        except ActorFault as fault:
            self.engines.restart(fault)
            self._lost(engine)
            return
        self.busy[engine] += report.seconds
        finished = []
        for key, samples in report.groups:
            group = self.running.pop(key, None)
            if group is not None:
                group.samples = samples
                finished.append(group)
        if not report.running:  # it holds none: any still counted on it were lost (a restart behind a sync)
            self._lost(engine)
        self._dispatch()  # the engine's next call before scoring: it does not wait on the rewards
        if finished:
            self._score(finished)

    def _lost(self, engine: int) -> None:
        """Groups of a restarted engine (by this stream, the pause or the sync): generated again from
        their start, by the policy it now holds."""
        lost = [g for g in self.running.values() if g.engine == engine]
        for g in reversed(lost):
            del self.running[g.key]
            g.engine, g.started, g.loads = None, -1, 0
            self.waiting.appendleft(g)
        self.counts["stream/regenerated"] += len(lost)

    def _score(self, groups: list[StreamGroup]) -> None:
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
        kept: list[StreamGroup] = []
        spare: list[StreamGroup] = []
        scored: list[tuple[int, list[float]]] = []
        refills = self.algo.max_refill_rounds * P if self.algo.dynamic_sampling else 0

        def enough() -> bool:
            while self.done and len(kept) < P:
                group = self.done.pop(0)
                scored.append((group.index, group.rewards.tolist()))
                if step - group.oldest > K:
                    self._discard("stream/dropped_stale")
                elif self.algo.dynamic_sampling and bool(zero_std_mask(group.rewards, G)[0]) and \
                        len(spare) < refills:
                    spare.append(group)
                    self._discard("dynamic_sampling/filtered")
                else:
                    kept.append(group)
            return len(kept) >= P

        t0 = time.perf_counter()
        self.pump(enough)
        exp = self._experience(kept, scored, step)
        exp.metrics["time/generate"] = time.perf_counter() - t0  # the step's wait for its groups
        return exp

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
        exp.metrics = {**_mean_of([g.metrics for g in groups]), **self._lags(exp.rollouts, step),
                       **{k: float(v) for k, v in self.counts.items()}, **lengths,
                       "stream/running": float(len(self.running)), "stream/done_waiting": float(len(self.done)),
                       "stream/overtook": float(sum(g.key > min(self.running, default=g.key) for g in groups)),
                       "rollout/tokens_per_s": self.tokens / max(1e-9, time.perf_counter() - self.since),
                       "reward/frac_zero_std": sum(bool(zero_std_mask(g.rewards, len(g.rewards))[0]) for g in groups)
                       / len(groups), "time/reward": self.scoring}
        exp.engine_seconds, self.since, self.tokens, self.scoring = dict(self.busy), time.perf_counter(), 0, 0.0
        self.busy.clear()
        return exp

    @staticmethod
    def _lags(rollouts: list[Rollout], step: int) -> dict[str, float]:
        """Staleness per sample (its oldest token) and per token."""
        lags = [step - r.policy_version for r in rollouts]
        tokens = [step - v for r in rollouts for v in r.versions]
        return {"staleness/lag_mean": sum(lags) / len(lags), "staleness/lag_max": float(max(lags)),
                "staleness/token_lag_mean": sum(tokens) / max(1, len(tokens)),
                "staleness/token_lag_max": float(max(tokens, default=0)),
                "stream/partial_frac": sum(len(set(r.versions)) > 1 for r in rollouts) / len(rollouts)}

    def pause(self) -> None:
        """Before a weight sync: no new calls; the calls in flight come back; each engine pauses (a
        running group that can no longer train within the bound, or past its interruptions, stops)."""
        self.paused = True
        self.pump(lambda: not self.calls)
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
        self.engines.stream_hold({i: stop[i] for i in range(len(self.engines.names))})

    def resume(self, version: int) -> None:
        """After the sync: the engines hold `version`; the running samples go on under it."""
        for g in self.running.values():
            g.loads += 1
        self.version, self.paused = version, False
        self.counts["stream/interrupted"] += len(self.running)
        self._dispatch()

    def experience(self, step: int) -> Experience:
        return self.take(step)

    def during(self, training: Any, step: int) -> list[Any]:
        """The engines go on while the learners train; the training's results."""
        self.pump(training.done, also=training.refs)
        return training()

    def sync(self, learners: Any, version: int) -> dict[str, float]:
        """The policy `version` into the engines, between two of their steps; the sync's stats."""
        self.pause()
        stats = self.engines.sync_from(learners)
        self.resume(version)
        return stats

    def payload(self) -> dict[str, Any]:
        return {"stream": self.state()}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the groups done and not trained (their samples), and the prompts of
        the others (generated again from their start after a resume)."""
        import dataclasses

        return {"version": self.version, "admitted": self.admitted, "discarded": self.discarded, "keys": self.keys,
                "done": [{"key": g.key, "index": g.index, "seed": g.seed, "started": g.started,
                          "samples": [dataclasses.asdict(s) for s in g.samples]} for g in self.done],
                "pending": [(g.key, g.index, g.seed) for g in [*self.running.values(), *self.waiting]]}


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def stream_from(state: dict[str, Any] | None, stream: GroupStream) -> GroupStream:
    """`stream` with a checkpoint's `state`: its groups done are scored again, the others wait."""
    from rlkit.grpo.experience import restored_sample

    if not state:
        return stream
    stream.admitted, stream.discarded, stream.keys = state["admitted"], state["discarded"], state["keys"]
    stream.waiting.extend(StreamGroup(k, i, s) for k, i, s in state["pending"])
    done = [StreamGroup(d["key"], d["index"], d["seed"], d["started"],
                        samples=[restored_sample(s) for s in d["samples"]]) for d in state["done"]]
    if done:
        stream._score(done)
    return stream
