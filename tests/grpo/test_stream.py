"""The stream's bookkeeping at a weight sync (`GroupStream._stops`): which running groups stop, and
how each is counted. The engines are not called there; the runs that stream for real are
tests/e2e/test_grpo_stream.py and tests/sync/test_weight_sync.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.stream import GroupStream
from rlkit.grpo.stream_state import StreamGroup
from rlkit.rollout.samples import Sampling


def _stream(version: int, **algo) -> GroupStream:
    config = GRPOAlgoConfig(streaming=True, max_staleness=2, **algo)
    return GroupStream(None, SimpleNamespace(names=["engine-0", "engine-1"]), None, Sampling(), config, 0, version, 16)


@pytest.mark.parametrize("over, stopped, counts", [
    ("drop", [[1], [3]], {"stream/dropped_stale": 1, "stream/dropped_interrupted": 1}),
    ("finish", [[1], []], {"stream/dropped_stale": 1, "stream/over_interrupted": 1}),
])
def test_a_sync_stops_the_groups_too_old_to_train_and_those_past_their_interruptions(over, stopped, counts):
    stream = _stream(5, max_interruptions=1, over_interrupted=over)
    groups = [StreamGroup(1, 0, 0, started=3, engine=0),  # at version 6 it would be 3 versions old: > K 2
              StreamGroup(2, 1, 0, started=4, engine=0, loads=0),  # within both bounds: goes on
              StreamGroup(3, 2, 0, started=5, engine=1, loads=1)]  # its second load: past max_interruptions 1
    stream.running = {g.key: g for g in groups}
    assert stream._stops() == {0: stopped[0], 1: stopped[1]}
    assert sorted(stream.running) == sorted({1, 2, 3} - set(stopped[0]) - set(stopped[1]))
    assert dict(stream.counts) == counts and stream.discarded == len(stopped[0]) + len(stopped[1])
