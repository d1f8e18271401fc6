"""Smoke test of `scripts/bench_dpo.py`: a few steps on the tiny model, padding-free DPO and the
reward model, the table and that both sides train on the same tokens at every step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

ROW = re.compile(r"^(dpo-pf|dpo|rm)\s+(rlkit|TRL)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+)\s+(\d+\.\d\d)"
                 r"(?:\s+(\d+\.\d\d)x)?$")


def test_bench_dpo_prints_table_and_both_sides_see_the_same_tokens(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_dpo.py"), "--size", "tiny", "--stages", "dpo-pf,rm",
         "--steps", "3", "--warmup", "1", "--micro-batch", "2", "--rows", "16", "--cutoff", "96", "--repeat", "1",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("model tiny") and "2 pairs a step" in line and "steps 3" in line for line in lines)
    rows = {(m.group(1), m.group(2)): m for m in map(ROW.match, lines) if m}
    assert set(rows) == {(stage, side) for stage in ("dpo-pf", "rm") for side in ("rlkit", "TRL")}, proc.stdout
    for (stage, side), m in rows.items():
        median, low, high, n, peak = (float(m.group(i)) for i in (3, 4, 5, 6, 7))
        assert 0 < low <= median <= high and n == 2 and peak > 0.1
        if side == "rlkit":
            assert float(m.group(8)) == pytest.approx(median / float(rows[(stage, "TRL")].group(3)), abs=0.01)
    for r in json.loads(out.read_text())["results"].values():
        (ours,), (theirs,) = r["runs"]["rlkit"], r["runs"]["trl"]
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]  # the same pairs, step by step
