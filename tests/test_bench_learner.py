"""Smoke test of `scripts/bench_learner.py`: a few steps of the tiny model, the table's rows and arithmetic."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

ROW = re.compile(r"^(\S+)\s+(step|ref|old)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s+(\d+)\s+(\d+\.\d)%"
                 r"\s+(\S+)\s+(\S+)$")


def test_bench_learner_prints_each_row_against_the_bare_loop(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_learner.py"), "--model", "tiny", "--batch", "2", "--seq", "64",
         "--steps", "2", "--warmup", "1", "--repeat", "1", "--rows", "bare,sft-z0,grpo-z0,sft-z3x2,bare-all,sft-z0-all",
         "--json", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("model tiny (")):]  # DeepSpeed's lines
    assert "2 x 64 tokens" in lines[0] and "device cpu" in lines[0]
    assert lines[1].startswith("MFU against the measured GEMM rate of one process")
    rows = {(m.group(1), m.group(2)): m for m in map(ROW.match, lines) if m}
    assert set(rows) == {("bare", "step"), ("sft-z0", "step"), ("grpo-z0", "step"), ("grpo-z0", "ref"),
                         ("grpo-z0", "old"), ("sft-z3x2", "step"), ("bare-all", "step"), ("sft-z0-all", "step")}, \
        proc.stdout
    saved = json.loads(out.read_text())
    flops, peak = saved["flops"], saved["peak_flops"]
    assert flops["train"] == pytest.approx(3 * flops["score"])  # a step is 3 x a forward
    medians = {(row, part): statistics.median(t for r in saved["runs"][row] for t in r[part]) for row, part in rows}
    # the lm_head on the positions each row projects: the bare loop's logits all 128, rlkit's head the labelled
    # 2 x 48 (the last 3/4), or 2 x 63 with every token labelled (the first has no prediction)
    assert flops["positions"] == {"bare": 128, "sft-z0": 96, "grpo-z0": 96, "sft-z3x2": 96, "bare-all": 128,
                                  "sft-z0-all": 126}
    for (row, part), m in rows.items():  # each printed cell is the saved timings' figure, to its printed digits
        median, low, high, n = float(m.group(3)), float(m.group(4)), float(m.group(5)), int(m.group(6))
        assert 0 < low <= median <= high and n == 2
        true = medians[(row, part)]
        assert median == pytest.approx(true, abs=0.00051)
        assert int(m.group(7)) == pytest.approx(2 * 64 / true, abs=0.51)  # tokens/s
        times, work = (3, flops["train"]) if part == "step" else (1, flops["score"])
        work -= times * flops["head_position"] * (128 - flops["positions"][row])
        mfu = work / true / peak / (2 if row.endswith("x2") else 1)  # two ranks: two devices' peak
        assert float(m.group(8)) == pytest.approx(100 * mfu, abs=0.051)
        if part == "step":  # an -all row against bare-all, marked like for like
            bare = medians[("bare-all" if row.endswith("-all") else "bare", "step")]
            assert m.group(10).endswith("x=" if row.endswith("-all") else "x")
            assert float(m.group(10).rstrip("x=")) == pytest.approx(true / bare, abs=0.0051)
            assert float(m.group(9)) > 0.1  # GiB: a process with torch in it
