"""The README path on CPU, as a user runs it: `rlkit demo`, which is the README's first two
commands (`rlkit sft recipes/tiny-sft.yaml`, which builds the tiny model and task offline, then
`rlkit grpo recipes/tiny-grpo.yaml` from its output) and its plot, then the README's and the
getting-started page's commands on those runs, as written (eval, plot, export). GRPO must raise
held-out exact-answer accuracy (greedy, prompts GRPO never trained on) by >= 20 points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.docs import command_on, run_rlkit
from tests.helpers import ROOT

# not alone: the other worker's test beside it (a run of about 1.4 cores) leaves `rlkit demo` well within
# twice the time the README states for it alone (the bound below); held alone, the other worker idled
pytestmark = pytest.mark.slow



RLKIT_LINE = re.compile(r"^(rlkit[ :]|step \d+/\d+ )")  # rlkit's own lines: its messages and the progress


def test_the_demo_and_the_first_run_raise_held_out_accuracy(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")  # the README's commands name recipes/ from the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rlkit.cli", "demo"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    seconds = time.perf_counter() - start
    # the demo ran the README's first two commands, as they are written there
    said = [line for line in res.stdout.splitlines() if ": final model in " in line]
    readme = [command_on("README.md", f"rlkit {stage} recipes/tiny-{stage}.yaml") for stage in ("sft", "grpo")]
    assert [line.split(":")[0] for line in said] == readme, res.stdout
    assert all(f"final model in runs/tiny-{stage}/final" in line for stage, line in zip(("sft", "grpo"), said))
    # a quiet console: Ray's, DeepSpeed's, vLLM's and the actors' output is in the runs' logs/, not here
    console = (res.stdout + res.stderr).splitlines()
    assert [line for line in console if not RLKIT_LINE.match(line)] == [], console
    for stage, actors in (("sft", ["learner-0"]), ("grpo", ["engine-0", "engine-1", "learner-0", "learner-1"])):
        logs = tmp_path / "runs" / f"tiny-{stage}" / "logs"
        assert sorted(p.stem for p in logs.glob("*.log")) == sorted(["driver", *actors])
        assert "Setting accelerator to CPU" in (logs / "learner-0.log").read_text()  # DeepSpeed's, kept in full
    assert (tmp_path / "runs" / "tiny-plots" / "grpo" / "curves.png").is_file()
    rows = [json.loads(x) for x in (tmp_path / "runs" / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    assert evals[0][0] == 0 and evals[-1][0] == 40, evals
    assert f"held-out exact-answer accuracy {evals[0][1]:.3f} (step 0) -> {evals[-1][1]:.3f} (step 40)" in said[1]
    last = rows[-1]  # each process's peak memory, logged at the first and the last step
    assert last["step"] == 40 and 0 < last["memory/learner_model_gib"] < last["memory/learner_peak_gib"] < 8
    assert 0 < last["memory/engine_model_gib"] < last["memory/engine_peak_gib"] < 8
    gain = evals[-1][1] - evals[0][1]
    assert gain >= 0.20, f"held-out exact-answer accuracy {evals} (gain {gain:+.3f}); took {seconds:.0f} s"
    # the README's eval lines run the held-out eval's code: they give the run's first and last figures
    for model, (step, accuracy) in (("tiny-sft", evals[0]), ("tiny-grpo", evals[-1])):
        res = run_rlkit(command_on("README.md", f"rlkit eval runs/{model}/final"), tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        report = json.loads((tmp_path / f"{model}.json").read_text())
        assert report["prompts"] == 61 and report["sampling"]["temperature"] == 0
        # greedy on CPU in fp32; one engine here, two in the run (other batches): one flip at most
        assert abs(report["rewards"]["exact_match"] - accuracy) <= 1 / 61 + 1e-9, (model, step, accuracy, report)
    res = run_rlkit(command_on("README.md", "rlkit plot"), tmp_path)
    assert res.returncode == 0 and "curves.png" in res.stdout, res.stderr[-3000:]
    res = run_rlkit(command_on("docs/getting-started.md", "rlkit export"), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "tiny-sft-step1200" / "config.json").is_file()
    # the time the README and the getting-started page state for the demo is kept honest
    for page in ("README.md", "docs/getting-started.md"):
        said = re.search(r"It takes about \w+\s+minutes on two cores \((\d+) s measured", (ROOT / page).read_text())
        stated = int(said[1])
        assert seconds < 2 * stated, (f"{page} says the demo takes {stated} s; it took {seconds:.0f} s here: measure "
                                      "`rlkit demo` alone and say so")
