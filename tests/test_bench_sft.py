"""Smoke test of `scripts/bench_sft.py`: a few steps on the tiny model, output format only."""

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

ROW = re.compile(r"^(no packing|packing)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d\d)x\s+\d+%\s+\d+%\s+\d+ x \d+$")


def test_bench_sft_prints_table(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_sft.py"), "--size", "tiny", "--steps", "3", "--warmup", "1",
         "--micro-batch", "2", "--rows", "24", "--cutoff", "128", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("model tiny") and "micro batch 2" in line and "steps 3" in line for line in lines)
    rows = {m.group(1): m for m in map(ROW.match, lines) if m}
    assert set(rows) == {"no packing", "packing"}, proc.stdout
    for m in rows.values():
        ours, theirs, ratio = float(m.group(2)), float(m.group(3)), float(m.group(4))
        assert ours > 0 and theirs > 0
        assert ratio == pytest.approx(ours / theirs, abs=0.01)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"nopack", "pack"}
    for r in results.values():
        (ours,), (theirs,) = r["rlkit_runs"], r["trl_runs"]
        assert ours["steps"] == theirs["steps"] == 2 and ours["tokens"] > 0 and theirs["tokens"] > 0
    # Without packing both sides train on the same samples at every step.
    nopack = results["nopack"]
    assert nopack["rlkit_runs"][0]["tokens"] == nopack["trl_runs"][0]["tokens"]
    assert nopack["rlkit_runs"][0]["padded"] == nopack["trl_runs"][0]["padded"]
