"""Smoke test of `scripts/bench_grpo.py`: a few steps on the tiny model, output format only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

NUM = r"(\d+\.\d+)"
SIDE = re.compile(rf"^(rlkit grpo|TRL GRPOTrainer \(generate\))\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$")
RATIO = re.compile(rf"^ratio rlkit / TRL {NUM}x$")
STEP = re.compile(rf"^rlkit step {NUM} s = generate {NUM} \+ reward {NUM} \+ ref {NUM} \+ train {NUM} "
                  rf"\+ sync {NUM} \+ other (-?\d+\.\d+)$")
BARE = re.compile(rf"^bare generate {NUM} s \(mean len {NUM}\) \+ bare train {NUM} s = {NUM} s; "
                  rf"rlkit overhead (-?\d+\.\d)%$")


def test_bench_grpo_prints_table(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_grpo.py"), "--size", "tiny", "--steps", "3", "--warmup", "1",
         "--prompts", "2", "--group", "4", "--max-tokens", "8", "--micro-batch", "4", "--sync-generation",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("model tiny") and "2 prompts x group 4 = 8 completions/step" in line
               and "max_tokens 8" in line for line in lines), proc.stdout
    sides = {m.group(1).split()[0]: m for m in map(SIDE.match, lines) if m}
    assert set(sides) == {"rlkit", "TRL"}, proc.stdout
    for m in sides.values():
        sps, step, _gen, length = map(float, m.groups()[1:])
        assert sps > 0 and step > 0 and 0 < length <= 8
        assert sps == pytest.approx(8 / step, rel=0.01)
    ratio = [m for m in map(RATIO.match, lines) if m]
    assert len(ratio) == 1
    assert float(ratio[0].group(1)) == pytest.approx(
        float(sides["rlkit"].group(2)) / float(sides["TRL"].group(2)), abs=0.01)
    step = [m for m in map(STEP.match, lines) if m]
    assert len(step) == 1 and float(step[0].group(1)) == pytest.approx(sum(map(float, step[0].groups()[1:])), abs=0.01)
    bare = [m for m in map(BARE.match, lines) if m]
    assert len(bare) == 1, proc.stdout
    results = json.loads(out.read_text())["results"]
    # Both sides timed the same number of steps; the bare parts one call/step each after warm-up.
    assert len(results["rlkit"]["steps"]) == 3 and len(results["trl"]["steps"]) == 2
    assert len(results["bare"]["generate_steps"]) == len(results["bare"]["train_steps"]) == 2
    assert results["overhead"] == pytest.approx(
        results["rlkit"]["time/step"] / (results["bare"]["time/generate"] + results["bare"]["time/train"]) - 1)
