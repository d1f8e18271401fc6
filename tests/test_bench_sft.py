"""Smoke test of `scripts/bench_sft.py`: a few steps on the tiny model, output format only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

ROW = re.compile(r"^(no packing|packing)\s+(rlkit|TRL)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+)\s+\d+%"
                 r"(?:\s+(\d+\.\d\d)x\s+\d+ x \d+)?$")


def test_bench_sft_prints_table(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_sft.py"), "--size", "tiny", "--steps", "3", "--warmup", "1",
         "--micro-batch", "2", "--rows", "24", "--cutoff", "128", "--repeat", "1", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("model tiny") and "micro batch 2" in line and "steps 3" in line for line in lines)
    rows = {(m.group(1), m.group(2)): m for m in map(ROW.match, lines) if m}
    assert set(rows) == {(mode, side) for mode in ("no packing", "packing") for side in ("rlkit", "TRL")}, proc.stdout
    for (mode, side), m in rows.items():
        median, low, high, n = float(m.group(3)), float(m.group(4)), float(m.group(5)), int(m.group(6))
        assert 0 < low <= median <= high and n == 2
        if side == "rlkit":  # the ratio of the medians, on the rlkit row
            assert float(m.group(7)) == pytest.approx(median / float(rows[(mode, "TRL")].group(3)), abs=0.01)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"nopack", "pack"}
    for r in results.values():
        (ours,), (theirs,) = r["rlkit_runs"], r["trl_runs"]
        assert len(ours) == len(theirs) == 2 and all(step[0] > 0 and step[2] > 0 for step in ours + theirs)
    # Without packing both sides train on the same samples at every step: the same tokens and padding.
    nopack = results["nopack"]
    assert [s[:2] for s in nopack["rlkit_runs"][0]] == [s[:2] for s in nopack["trl_runs"][0]]
