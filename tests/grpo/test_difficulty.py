"""Online difficulty: which prompts are easy or hard, how much less the sampler draws them
within the difficulty schedule's level mix, and that its state resumes exactly."""

from __future__ import annotations

import collections
import random

import pytest

from rlkit.data.curriculum import CurriculumSampler
from rlkit.grpo.difficulty import OnlineDifficulty


def test_status_follows_the_last_group():
    online = OnlineDifficulty(10, keep=0.25, solved_at=1.0, failed_at=0.0)
    online.observe(1, [1.0, 1.0, 1.5])  # all solved
    online.observe(2, [0.0, -0.5, 0.0])  # all failed
    online.observe(3, [1.0, 0.0, 1.0])  # mixed: teaches something
    online.observe(4, [1.0, float("nan")])  # a missing reward is neither
    assert online.status == {1: "easy", 2: "hard"}
    online.observe(1, [1.0, 0.0])  # a later mixed group resets the row
    assert online.status == {2: "hard"}
    rng = random.Random(0)
    kept = sum(online.accept(2, rng) for _ in range(4000))
    assert kept / 4000 == pytest.approx(0.25, abs=0.03)
    assert all(online.accept(3, rng) for _ in range(100))  # normal rows: always, no RNG draw
    metrics = online.metrics()
    assert metrics == {"online_difficulty/easy_frac": 0.0, "online_difficulty/hard_frac": 0.1,
                       "online_difficulty/skipped": 4000.0 - kept}
    assert online.metrics()["online_difficulty/skipped"] == 0.0  # counted since the last call
    with pytest.raises(ValueError, match="keep must be in"):
        OnlineDifficulty(10, keep=0.0, solved_at=1.0, failed_at=0.0)


def _sampler(online, steps=200):
    levels = ["explain"] * 20 + ["reasoning"] * 20 + ["topology"] * 20
    return CurriculumSampler(levels, steps, 6, seed=3, phases=[(1.0, (0.5, 0.5, 0.0))], row_filter=online)


def test_easy_and_hard_rows_are_drawn_less_within_the_level_mix():
    online = OnlineDifficulty(60, keep=0.25, solved_at=1.0, failed_at=0.0)
    for row in range(0, 10):
        online.observe(row, [1.0, 1.0])  # half of "explain" solved
    for row in range(20, 30):
        online.observe(row, [0.0, 0.0])  # half of "reasoning" failed
    sampler = _sampler(online)
    counts = collections.Counter(i for _ in range(200) for i in sampler.next_batch())
    per_level = [sum(counts[i] for i in range(a, a + 20)) for a in (0, 20, 40)]
    assert per_level == [600, 600, 0]  # the schedule's 50/50 mix is untouched
    for flagged, normal in ((range(0, 10), range(10, 20)), (range(20, 30), range(30, 40))):
        ratio = sum(counts[i] for i in flagged) / sum(counts[i] for i in normal)
        assert ratio == pytest.approx(0.25, abs=0.06), ratio


def test_sampler_state_holds_the_online_difficulty():
    def run(interrupt_at=None):
        online = OnlineDifficulty(60, keep=0.3, solved_at=1.0, failed_at=0.0)
        sampler, batches = _sampler(online), []
        for step in range(30):
            if step == interrupt_at:  # a checkpoint, then a fresh process resumes from it
                state = sampler.state_dict()
                online = OnlineDifficulty(60, keep=0.3, solved_at=1.0, failed_at=0.0)
                sampler = _sampler(online)
                sampler.load_state_dict(state)
            batch = sampler.next_batch()
            for row in batch:  # rows of even index come back solved, odd ones mixed
                online.observe(row, [1.0, 1.0] if row % 2 == 0 else [1.0, 0.0])
            batches.append(batch)
        return batches, online.status

    assert run() == run(interrupt_at=17)
    assert run()[1] and all(row % 2 == 0 for row in run()[1])
