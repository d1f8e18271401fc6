"""The README path on CPU, as a user runs it: `rlkit sft recipes/tiny-sft.yaml` (tiny model and
task built offline), then `rlkit grpo recipes/tiny-grpo.yaml` from its output. GRPO must raise
held-out exact-answer accuracy (greedy, prompts GRPO never trained on) by >= 20 points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_recipes_raise_held_out_exact_accuracy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seconds = {}
    for stage in ("sft", "grpo"):
        start = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "rlkit.cli", stage, str(ROOT / "recipes" / f"tiny-{stage}.yaml"),
                              "logging.progress=none"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=1200)
        assert res.returncode == 0, res.stderr[-3000:]
        seconds[stage] = time.perf_counter() - start
    rows = [json.loads(x) for x in (tmp_path / "runs" / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    assert evals[0][0] == 0 and evals[-1][0] == 40, evals
    gain = evals[-1][1] - evals[0][1]
    assert gain >= 0.20, f"held-out exact-answer accuracy {evals} (gain {gain:+.3f}); took {seconds}"
    assert seconds["grpo"] < 15 * 60
