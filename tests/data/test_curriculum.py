"""Curriculum sampler: schedule, fallback, resume, resampling, phase validation."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import pytest

from rlkit.data.curriculum import DEFAULT_PHASES, CurriculumSampler, validate_phases
from rlkit.errors import DataError

LEVELS = ("explain", "reasoning", "topology")


def diffs(n_explain=300, n_reasoning=200, n_topology=100):
    return ["explain"] * n_explain + ["reasoning"] * n_reasoning + ["topology"] * n_topology


def test_phase_mix_schedule_seed_002():
    s = CurriculumSampler(diffs(), total_steps=100, batch_size=8, seed=0)
    assert s.phase_mix(0) == dict(zip(LEVELS, (0.8, 0.2, 0.0)))
    assert s.phase_mix(29) == dict(zip(LEVELS, (0.8, 0.2, 0.0)))
    assert s.phase_mix(30) == dict(zip(LEVELS, (0.4, 0.4, 0.2)))
    assert s.phase_mix(69) == dict(zip(LEVELS, (0.4, 0.4, 0.2)))
    assert s.phase_mix(70) == dict(zip(LEVELS, (0.25, 0.35, 0.40)))
    assert s.phase_mix(100) == dict(zip(LEVELS, (0.25, 0.35, 0.40)))  # past the end: last phase


def test_observed_mix_per_phase_matches_schedule():
    d = diffs()
    total, bs = 1000, 10
    s = CurriculumSampler(d, total_steps=total, batch_size=bs, seed=3)
    starts = [0, 300, 700]
    for (end, mix), start in zip(DEFAULT_PHASES, starts):
        counts = Counter()
        for _ in range(int(end * total) - start):
            batch = s.next_batch()
            assert len(batch) == bs
            counts.update(d[i] for i in batch)
        n = sum(counts.values())
        for lv, p in zip(LEVELS, mix):
            se = math.sqrt(p * (1 - p) / n) or 1e-9
            assert abs(counts[lv] / n - p) <= 3 * se + 1e-9, (lv, counts[lv] / n, p)
            if p == 0:
                assert counts[lv] == 0


def test_small_batches_still_follow_mix():
    d = diffs()
    s = CurriculumSampler(d, total_steps=1000, batch_size=3, seed=0)
    counts = Counter(d[i] for _ in range(300) for i in s.next_batch())
    assert counts == {"explain": 720, "reasoning": 180}  # 0.8 / 0.2 of 900 exactly


def test_deterministic_for_seed():
    a = CurriculumSampler(diffs(), 50, 4, seed=7)
    b = CurriculumSampler(diffs(), 50, 4, seed=7)
    c = CurriculumSampler(diffs(), 50, 4, seed=8)
    xa = [a.next_batch() for _ in range(50)]
    assert xa == [b.next_batch() for _ in range(50)]
    assert xa != [c.next_batch() for _ in range(50)]


@pytest.mark.parametrize("difficulties", [diffs(30, 20, 10), [None] * 25])
def test_resume_continues_identically(difficulties):
    total = 60
    ref = CurriculumSampler(difficulties, total, 4, seed=11)
    expected = [ref.next_batch() for _ in range(total)]
    s = CurriculumSampler(difficulties, total, 4, seed=11)
    got = [s.next_batch() for _ in range(25)]
    state = json.loads(json.dumps(s.state_dict()))  # must survive JSON
    resumed = CurriculumSampler(difficulties, total, 4, seed=999)
    resumed.load_state_dict(state)
    assert resumed.step == 25
    got += [resumed.next_batch() for _ in range(total - 25)]
    assert got == expected


def test_load_state_for_other_dataset_fails():
    s = CurriculumSampler(diffs(30, 20, 10), 10, 4, seed=0)
    other = CurriculumSampler(diffs(30, 20, 11), 10, 4, seed=0)
    with pytest.raises(ValueError, match="does not match this dataset"):
        other.load_state_dict(s.state_dict())


def test_level_with_few_rows_is_resampled():
    d = diffs(100, 100, 3)  # only 3 topology rows
    s = CurriculumSampler(d, total_steps=10, batch_size=20, seed=0)
    topo = [i for _ in range(10) for i in s.next_batch() if d[i] == "topology"]
    assert len(topo) > 3 * 5
    assert set(topo) == {200, 201, 202}
    # drawn without replacement until the pool is exhausted, then refilled: uses stay balanced
    uses = Counter(topo).values()
    assert max(uses) - min(uses) <= 1


def test_plain_epochs_without_difficulty_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        s = CurriculumSampler([None] * 10, total_steps=5, batch_size=5, seed=0)
    lines = [r for r in caplog.records if r.name == "rlkit"]
    assert len(lines) == 1 and "no row has a 'difficulty' field" in lines[0].getMessage()
    assert not s.curriculum and s.phase_mix(0) == {}
    first, second = s.next_batch(), s.next_batch()
    assert sorted(first + second) == list(range(10))  # one epoch, each row once
    assert "curriculum off" in s.describe()


def test_disabled_ignores_difficulties(caplog):
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        s = CurriculumSampler(["bogus"] * 4, 2, 2, seed=0, enabled=False)
    assert not caplog.records and sorted(s.next_batch() + s.next_batch()) == [0, 1, 2, 3]


def test_unknown_and_missing_difficulty():
    with pytest.raises(DataError, match=r"row 2: unknown difficulty 'hard' \(allowed: explain, reasoning, topology; "
                                        r"set curriculum.levels to your data's levels, easiest first\)"):
        CurriculumSampler(["explain", "hard"], 10, 2, seed=0)
    with pytest.raises(DataError, match="row 3 has no 'difficulty' while other rows do"):
        CurriculumSampler(["explain", "topology", None], 10, 2, seed=0)
    # the data file is named (the driver passes data.train)
    with pytest.raises(DataError, match=r"^data/train.jsonl: row 2: unknown difficulty 'hard' "):
        CurriculumSampler(["explain", "hard"], 10, 2, seed=0, source="data/train.jsonl")


def test_numeric_difficulty_is_bucketed_easiest_first(caplog):
    """Numbers (1..9 here) become the levels by equal-count buckets; the first phase (80/20/0)
    then draws from 1..3 and 4..6 only."""
    d = [v for v in range(1, 10) for _ in range(10)]
    with caplog.at_level(logging.INFO, logger="rlkit"):
        s = CurriculumSampler(d, total_steps=10, batch_size=10, seed=0)
    assert s.level_counts == {"explain": 30, "reasoning": 30, "topology": 30}
    assert "explain 1..3, reasoning 4..6, topology 7..9" in caplog.text
    first = [d[i] for i in s.next_batch()]
    assert Counter(v <= 3 for v in first)[True] == 8 and max(first) <= 6
    with pytest.raises(DataError, match=r"row 2: difficulty 'hard' is a name but other rows give numbers"):
        CurriculumSampler([1, "hard", 2], 10, 2, seed=0)
    with pytest.raises(DataError, match=r"row 1: difficulty is list \(expected a level name such as 'explain'"):
        CurriculumSampler([[1], 2], 10, 2, seed=0)


def test_curriculum_is_off_unless_asked_and_then_ignores_the_column(tmp_path):
    """Off by default: a `difficulty` column of any kind loads and is not read."""
    from rlkit.config import CurriculumConfig
    from rlkit.data.formats import load_rows

    assert CurriculumConfig().enabled is False
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps({"instruction": "q", "output": "a", "difficulty": d})
                           for d in ("easy", 3, {"level": 1})))
    assert [r["difficulty"] for r in load_rows(str(p)).rows] == ["easy", 3, {"level": 1}]
    s = CurriculumSampler(["easy", 3, {"level": 1}], 2, 3, seed=0, enabled=False)
    assert sorted(s.next_batch()) == [0, 1, 2]


def test_empty_level_renormalised_and_recorded(caplog):
    d = diffs(50, 50, 0)
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        s = CurriculumSampler(d, total_steps=10, batch_size=10, seed=0)
    assert s.phase_mix(0) == dict(zip(LEVELS, (0.8, 0.2, 0.0)))  # phase 1 does not ask for topology
    assert s.phase_mix(5) == pytest.approx({"explain": 0.5, "reasoning": 0.5, "topology": 0.0})
    assert s.phase_mix(9) == pytest.approx({"explain": 0.25 / 0.6, "reasoning": 0.35 / 0.6, "topology": 0.0})
    assert len(s.adjustments) == 2 and "phase 2: no rows for topology" in s.adjustments[0]
    assert "mix renormalised" in caplog.text
    for _ in range(10):
        assert len(s.next_batch()) == 10


def test_custom_levels_and_phases():
    d = ["easy"] * 10 + ["hard"] * 10
    s = CurriculumSampler(d, total_steps=4, batch_size=4, seed=0, levels=("easy", "hard"),
                          phases=((0.5, (1.0, 0.0)), (1.0, (0.0, 1.0))))
    assert all(d[i] == "easy" for i in s.next_batch() + s.next_batch())
    assert all(d[i] == "hard" for i in s.next_batch() + s.next_batch())
    assert "easy=10 hard=10" in s.describe() and "[0%,50%) 1.00/0.00" in s.describe()


@pytest.mark.parametrize("levels, phases, msg", [
    (LEVELS, ((0.5, (1, 0, 0)), (0.4, (1, 0, 0)), (1.0, (1, 0, 0))),
     "phases[1].until: phase ends must increase within (0, 1], got 0.4 after 0.5"),
    (LEVELS, ((0.5, (0.5, 0.5)), (1.0, (1, 0, 0))), "phases[0].mix: needs one share per level "
                                                 "['explain', 'reasoning', 'topology'], got 2"),
    (LEVELS, ((1.0, (0.5, 0.3, 0.1)),), "phases[0].mix: mix [0.5, 0.3, 0.1] sums to 0.9, expected 1"),
    (LEVELS, ((0.5, (1, 0, 0)),), "phases: the last phase must end at until: 1.0, got 0.5"),
    (LEVELS, ((1.0, (1.2, -0.2, 0)),), "must be non-negative"),
    (LEVELS, (), "at least one phase"),
    (("a", "a"), ((1.0, (0.5, 0.5)),), "levels must be unique"),
    (LEVELS, ((1.0,),), "expected [end_fraction, [shares]]"),
])
def test_validate_phases_errors(levels, phases, msg):
    with pytest.raises(ValueError) as e:
        validate_phases(levels, phases)
    assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError):
        CurriculumSampler(["a"], 10, 2, seed=0, levels=levels, phases=phases)


def test_validate_phases_accepts_default():
    validate_phases(LEVELS, DEFAULT_PHASES)
