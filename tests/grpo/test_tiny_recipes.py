"""The README path on CPU, as a user runs it: `rlkit sft recipes/tiny-sft.yaml` (tiny model and
task built offline), then `rlkit grpo recipes/tiny-grpo.yaml` from its output. GRPO must raise
held-out exact-answer accuracy (greedy, prompts GRPO never trained on) by >= 20 points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


RLKIT_LINE = re.compile(r"^(rlkit[ :]|step \d+/\d+ )")  # rlkit's own lines: its messages and the progress


def test_tiny_recipes_raise_held_out_exact_accuracy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seconds = {}
    for stage in ("sft", "grpo"):
        start = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "rlkit.cli", stage, str(ROOT / "recipes" / f"tiny-{stage}.yaml"),
                              "logging.progress=plain"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=1200)
        assert res.returncode == 0, res.stderr[-3000:]
        seconds[stage] = time.perf_counter() - start
        # a quiet console: Ray's, DeepSpeed's, vLLM's and the actors' output is in the run's logs/, not here
        console = (res.stdout + res.stderr).splitlines()
        assert [line for line in console if not RLKIT_LINE.match(line)] == [], stage
        logs = tmp_path / "runs" / f"tiny-{stage}" / "logs"
        actors = {"sft": ["learner-0"], "grpo": ["engine-0", "engine-1", "learner-0", "learner-1"]}[stage]
        assert sorted(p.stem for p in logs.glob("*.log")) == sorted(["driver", *actors])
        assert "Setting accelerator to CPU" in (logs / "learner-0.log").read_text()  # DeepSpeed's, kept in full
    rows = [json.loads(x) for x in (tmp_path / "runs" / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    assert evals[0][0] == 0 and evals[-1][0] == 40, evals
    last = rows[-1]  # each process's peak memory, logged at the first and the last step
    assert last["step"] == 40 and 0 < last["memory/learner_model_gib"] < last["memory/learner_peak_gib"] < 8
    assert 0 < last["memory/engine_model_gib"] < last["memory/engine_peak_gib"] < 8
    gain = evals[-1][1] - evals[0][1]
    assert gain >= 0.20, f"held-out exact-answer accuracy {evals} (gain {gain:+.3f}); took {seconds}"
    # rlkit eval with the recipe runs the held-out eval's code: it gives the run's first and last figures
    for model, (step, accuracy) in (("tiny-sft", evals[0]), ("tiny-grpo", evals[-1])):
        res = subprocess.run([sys.executable, "-m", "rlkit.cli", "eval", f"runs/{model}/final", "--recipe",
                              str(ROOT / "recipes" / "tiny-grpo.yaml"), "--out", f"{model}.json"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        report = json.loads((tmp_path / f"{model}.json").read_text())
        assert report["prompts"] == 61 and report["sampling"]["temperature"] == 0
        # greedy on CPU in fp32; one engine here, two in the run (other batches): one flip at most
        assert abs(report["rewards"]["exact_match"] - accuracy) <= 1 / 61 + 1e-9, (model, step, accuracy, report)
    assert seconds["grpo"] < 15 * 60
