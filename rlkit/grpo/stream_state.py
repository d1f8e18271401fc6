"""A streamed group (`StreamGroup`), what a checkpoint keeps of the stream (`kept`, `stream_from`),
and the staleness a step's groups show (`lags`): the plain parts of `grpo/stream.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlkit.grpo.experience import restored_sample

if TYPE_CHECKING:
    from rlkit.grpo.batch import Rollout
    from rlkit.rollout.samples import Sample


@dataclass
class StreamGroup:
    """One prompt's group on its way: admitted, sent to an engine, done, scored."""

    key: int
    index: int  # the row's index in the task's train rows
    seed: int
    started: int = -1  # the policy version of its first token (-1: not sent yet)
    engine: int | None = None
    call: int = 0  # the number of the engine call that sent it (`GroupStream.sent`)
    loads: int = 0  # weight loads it ran across
    samples: list[Sample] | None = None
    start: list[Sample] | None = None  # its samples as far as they got at the last checkpoint's cut
    rewards: Any = None  # [G] totals, [G, K] per function, the scoring batch's metrics
    per_fn: Any = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def oldest(self) -> int:
        """The version of its oldest token."""
        return min((v for s in self.samples or () for v in (s.versions or ())), default=self.started)


def kept(stream: Any) -> dict[str, Any]:
    """What a checkpoint keeps of `stream` (a `GroupStream`): the groups done and not trained (their samples), and the
    others: their samples so far at the last cut, or their prompt alone."""

    def group(g: StreamGroup, samples: list[Sample] | None) -> dict[str, Any]:
        return {"key": g.key, "index": g.index, "seed": g.seed, "started": g.started, "loads": g.loads,
                "samples": samples and [dataclasses.asdict(s) for s in samples]}

    return {"version": stream.version, "admitted": stream.admitted, "discarded": stream.discarded,
            "keys": stream.keys, "done": [group(g, g.samples) for g in stream.done],
            "pending": [group(g, g.start) for g in [*stream.running.values(), *stream.waiting]]}


def stream_from(state: dict[str, Any] | None, stream: Any) -> Any:
    """`stream` (a `GroupStream`) with a checkpoint's `state`: its groups done are scored again, the others wait (the
    ones cut mid-sample go on from their tokens)."""
    if not state:
        return stream

    def group(d: dict[str, Any]) -> tuple[StreamGroup, list[Sample] | None]:
        samples = d["samples"] and [restored_sample(s) for s in d["samples"]]
        started, loads = (d["started"], d["loads"]) if samples else (-1, 0)
        return StreamGroup(d["key"], d["index"], d["seed"], started, loads=loads), samples

    stream.admitted, stream.discarded, stream.keys = state["admitted"], state["discarded"], state["keys"]
    for g, start in map(group, state["pending"]):
        g.start = start
        stream.waiting.append(g)
    done = []
    for g, samples in map(group, state["done"]):
        g.samples = samples
        done.append(g)
    if done:
        stream.score(done)
    return stream


def lags(rollouts: list[Rollout], step: int) -> dict[str, float]:
    """Staleness per sample (its oldest token) and per token, of a step's rollouts."""
    per_sample = [step - r.policy_version for r in rollouts]
    tokens = [step - v for r in rollouts for v in r.versions]
    return {"staleness/lag_mean": sum(per_sample) / len(per_sample), "staleness/lag_max": float(max(per_sample)),
            "staleness/token_lag_mean": sum(tokens) / max(1, len(tokens)),
            "staleness/token_lag_max": float(max(tokens, default=0)),
            "stream/partial_frac": sum(len(set(r.versions)) > 1 for r in rollouts) / len(rollouts)}


def mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}
