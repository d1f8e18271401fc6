"""Smoke test of `scripts/bench_grpo.py`: a few steps on the tiny model, output format only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

NUM = r"(\d+\.\d+)"
SPREAD = rf"{NUM}\s+{NUM}\s+{NUM}\s+(\d+)"  # median, min, max, n
SIDE = re.compile(rf"^(rlkit grpo|TRL GRPOTrainer \(generate\))\s+{SPREAD}\s+{NUM}\s+{NUM}$")
BARE = re.compile(rf"^bare (generate|train)\s+{SPREAD}(?:\s+{NUM})?$")
RATIO = re.compile(rf"^ratio rlkit / TRL {NUM}x \(medians\)$")
STEP = re.compile(rf"^rlkit median step {NUM} s, async generation \(.*\): train {NUM} \+ sync {NUM} \+ reward {NUM} "
                  rf"\+ waiting for generation / other (-?\d+\.\d+)$")
TOGETHER = re.compile(rf"^bare (generate|train), both at once\s+{SPREAD}$")
LIMIT = re.compile(rf"^limit max\(bare generate, bare train\) \(overlapped\) = {NUM} s; "
                   rf"rlkit step {NUM} s = (\d+)% of it$")
SHARED = re.compile(rf"^limit with both at once, max\(bare generate, bare train\) = {NUM} s; "
                    rf"rlkit step = (\d+)% of it$")
LEARNER = re.compile(rf"^learner: rlkit train {NUM} s vs bare train {NUM} s = ([+-]\d+\.\d)%$")


def _one(pattern, lines):
    found = [m for m in map(pattern.match, lines) if m]
    assert len(found) == 1, (pattern.pattern, lines)
    return found[0]


def test_bench_grpo_prints_table(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_grpo.py"), "--size", "tiny", "--steps", "3", "--warmup", "1",
         "--prompts", "2", "--group", "4", "--max-tokens", "8", "--micro-batch", "4", "--repeat", "1",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("model tiny") and "2 prompts x group 4 = 8 completions/step" in line
               and "max_tokens 8" in line and "x 1 round(s)" in line for line in lines), proc.stdout
    sides = {m.group(1).split()[0]: m for m in map(SIDE.match, lines) if m}
    assert set(sides) == {"rlkit", "TRL"}, proc.stdout
    for m in sides.values():
        median, low, high, n, sps, length = map(float, m.groups()[1:])
        assert 0 < low <= median <= high and n == 2 and 0 < length <= 8
        # the median is printed to 1 ms: at 40 ms a step its rounding alone moves 8 / median by 1.2%
        assert sps == pytest.approx(8 / median, rel=0.0005 / median + 0.005)
    bare = {m.group(1): m for m in map(BARE.match, lines) if m}
    assert set(bare) == {"generate", "train"}, proc.stdout
    ratio = _one(RATIO, lines)
    step = _one(STEP, lines)  # async: the step is train + sync + reward + what it waited for generation
    assert float(step.group(1)) == pytest.approx(sum(map(float, step.groups()[1:])), abs=0.01)
    limit = _one(LIMIT, lines)
    assert float(limit.group(1)) == pytest.approx(max(float(bare["generate"].group(2)), float(bare["train"].group(2))),
                                                  abs=0.002)
    together = {m.group(1): m for m in map(TOGETHER.match, lines) if m}  # each while the other runs
    assert set(together) == {"generate", "train"} and all(int(m.group(5)) >= 1 for m in together.values())
    shared = _one(SHARED, lines)
    assert float(shared.group(1)) == pytest.approx(max(float(m.group(2)) for m in together.values()), abs=0.002)
    learner = _one(LEARNER, lines)
    assert float(learner.group(2)) == pytest.approx(float(bare["train"].group(2)), abs=0.001)
    results = json.loads(out.read_text())["results"]
    # Both sides timed the same number of steps; the bare parts one call/step each after warm-up.
    assert len(results["rlkit"]["steps"]) == 3 and len(results["trl"]["steps"]) == 2
    assert len(results["bare"]["generate_steps"]) == len(results["bare"]["train_steps"]) == 2
    assert results["of_limit"] == pytest.approx(results["rlkit"]["spread"]["median"] / results["limit"])
    assert int(limit.group(3)) == round(100 * results["of_limit"])
    assert results["ratio"] == pytest.approx(results["trl"]["spread"]["median"] / results["rlkit"]["spread"]["median"])
    assert float(ratio.group(1)) == round(results["ratio"], 2)
    assert int(shared.group(2)) == round(100 * results["of_shared_limit"])
