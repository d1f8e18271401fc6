"""`rlkit grpo` for real, as a user runs it (the CLI, its own Ray): stopped and resumed, faults, errors
before launch. The in-process runs of its losses, corrections and placements: test_grpo_variants.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from tests.conftest import left_running, marked_env
from tests.helpers import GRPO_RECIPE, first_rows, grpo_overrides, logged_steps, run_steps

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stop, staleness", [("sigterm", 0), ("kill9", 2)])
def test_grpo_stopped_then_resumed_matches_uninterrupted(request, sft_model, task_data, tmp_path, stop,
                                                        staleness):
    """Stopped and resumed: the same rewards per step and final weights as an uninterrupted run.
    SIGTERM (synchronous run) mid-interval: the run checkpoints at the end of that step and
    exits 3, leaving no process behind; before that, its rollout engine is killed (-9) in step
    3: the run restarts it, re-syncs it and sends its lost generation again, which (same seeds,
    same weights) changes nothing. kill -9 of everything while the engine loads the 9th
    policy (mid-sync, after the step-8 checkpoint; `scripts/kill_anywhere.py`'s weight_sync
    point), with max_staleness 2: the checkpoint holds the two generations in flight (made by
    older policies), so the resumed run trains on exactly what the uninterrupted one did; that
    run also has the online difficulty on, over 32 prompts drawn three times each, so the
    sampler's skips depend on the rewards seen before the kill. The uninterrupted run runs beside
    the stopped one (its own Ray, its own mark): they share nothing but the machine, and both are
    seeded, so neither's figures depend on the other's pace."""
    extra = [] if staleness == 0 else [
        "online_difficulty={keep: 0.25}",
        f"data.train={first_rows(task_data['grpo_train'], 32, tmp_path / 'train32.jsonl')}"]

    def cmd(out):
        return [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE),
                *grpo_overrides(sft_model, task_data, out, "grpo.steps=12", "checkpoint.every=4",
                                "eval.every=0", "logging.progress=plain", f"grpo.max_staleness={staleness}",
                                *extra)]

    env = marked_env(tmp_path.name)
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    uninterrupted = subprocess.Popen(cmd(clean), env=marked_env(f"{tmp_path.name}-clean"), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
    request.addfinalizer(uninterrupted.kill)  # (ended by then, unless the test failed before it did)
    with open(tmp_path / "stderr.txt", "w") as err:
        halt = {} if stop == "sigterm" else {"RLKIT_FAULT": "halt:weight_sync:engine0:8"}
        proc = subprocess.Popen(cmd(broken), env={**env, **halt}, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=err)
        deadline = time.time() + 600
        if stop == "sigterm":  # engine 0 dies as step 3 starts (its pid is in the run log)
            while logged_steps(broken) < 2:
                assert proc.poll() is None and time.time() < deadline, "run ended or stalled before the kill"
                time.sleep(0.1)
            os.kill(int(re.search(r"engine 0: pid (\d+)", (broken / "rlkit.log").read_text())[1]), signal.SIGKILL)
        if stop == "sigterm":
            while logged_steps(broken) < 5:
                assert proc.poll() is None and time.time() < deadline, "run ended or stalled before the stop"
                time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)  # the driver only, as a scheduler's preemption notice
            assert proc.wait(timeout=300) == 3
        else:  # the engine kills the run's process group (the driver and Ray's local services) mid-sync
            assert proc.wait(timeout=600) == -signal.SIGKILL
            assert (broken / "checkpoints" / "step-8").is_dir() and logged_steps(broken) < 12
            assert not left_running(tmp_path.name, wait_s=30)
    if stop == "sigterm":
        last = (tmp_path / "stderr.txt").read_text().strip().splitlines()[-1]
        at = max(r["step"] for r in run_steps(broken))
        assert last == (f"rlkit: stopped by SIGTERM after step {at}; checkpoint step-{at} is written: rerun the "
                        "same command to resume") and at % 4 and (broken / "checkpoints" / f"step-{at}").is_dir()
        assert not left_running(tmp_path.name)
        restart = re.search(r"^rlkit: engine 0 died during the (generation|weight sync) \(pid \d+, node [\d.]+; its "
                            r"process exited unexpectedly: .*\); (restarted and re-synced in [\d.]+ s|restarted in "
                            r"[\d.]+ s; the weight sync starts over) \(restart 1 of rollout.max_restarts 3\)$",
                            (tmp_path / "stderr.txt").read_text(), re.M)
        assert restart, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert [r["rollout/restarts"] for r in run_steps(broken)][:5] == [0, 0, 1, 1, 1]
    _, said = uninterrupted.communicate(timeout=900)
    assert uninterrupted.returncode == 0, said[-3000:]
    resumed = subprocess.run(cmd(broken), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    # One seeded engine: the resumed rollouts, rewards and weights equal the uninterrupted run's.
    ra = {r["step"]: r["reward/mean"] for r in run_steps(clean)}
    rb = {r["step"]: r["reward/mean"] for r in run_steps(broken)}
    assert sorted(rb) == list(range(1, 13)) and all(ra[s] == pytest.approx(rb[s], abs=1e-6) for s in ra)
    a, b = load_file(clean / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    if extra:  # the online difficulty acted after the checkpoint, and the same way in both runs
        skips = {r["step"]: r["online_difficulty/skipped"] for r in run_steps(clean)}
        assert sum(v for s, v in skips.items() if s > 8) > 0, skips
        assert skips == {r["step"]: r["online_difficulty/skipped"] for r in run_steps(broken)}


@pytest.mark.parametrize("fault, extra, error, steps", [
    # engine 1 drops one tensor of every sync: the parity probe after step 2 finds it
    ("sync_skip:layers.1.mlp.down_proj:1", ["rollout.sync_check_every=2"],
     "rlkit: error: sync check after step 2: engine 1 scores the check sequences up to ", 1),
    # engine 1 hangs in its third generation (step 2; the first is the evaluation before step 1):
    # restarted, re-synced, its generation sent again; the new engine hangs in its third
    # generation too (step 4), and one restart was all it had
    ("hang:generate:1:2", ["rollout.sync_timeout_s=3", "rollout.max_restarts=1"],
     "rlkit: error: engine 1 did not finish the generation within 3 s (rollout.sync_timeout_s); it is hung or "
     "far slower than expected: see its log, or raise rollout.sync_timeout_s; it was restarted 1 time already "
     "(rollout.max_restarts 1); ", 3),
    # learner 1 is killed (-9) in step 2's training, while learner 0 waits for it in a collective
    ("die:fit:learner1:1", ["grpo.num_learners=2"], "rlkit: error: learner 1 died during the training step (pid ", 1),
], ids=["broken-sync", "hung-engine", "dead-learner"])
def test_faults_stop_the_run_with_one_line(sft_model, task_data, tmp_path, fault, extra, error, steps):
    """A sync that misses a tensor, an engine that hangs past its restarts, a learner that dies:
    the run stops with one line naming the actor and the phase and the checkpoint a rerun resumes
    from, exit 2, within a bounded time, instead of training on or waiting forever; the checkpoint
    written before is intact, Ray's detail is in rlkit.log, and no process is left running."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE),
           *grpo_overrides(sft_model, task_data, out, "rollout.num_engines=2", "grpo.steps=6", "eval.every=0",
                           "checkpoint.every=1", *extra)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=marked_env(tmp_path.name, RLKIT_FAULT=fault), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(error), res.stderr[-3000:]
    assert last.endswith(f"; the newest checkpoint, step-{steps}, is intact: rerun the same command to resume from "
                         f"it (details: {out / 'rlkit.log'})")
    assert "Traceback" not in res.stderr
    assert time.monotonic() - t0 < 240
    assert [r["step"] for r in run_steps(out)] == list(range(1, steps + 1))
    assert (out / "checkpoints" / f"step-{steps}").is_dir()
    if fault.startswith("hang"):  # the first hang was survived
        assert re.search(r"^rlkit: engine 1 did not finish the generation within 3 s .*; restarted and re-synced in "
                         r"[\d.]+ s \(restart 1 of rollout.max_restarts 1\)$", res.stderr, re.M), res.stderr[-3000:]
        assert run_steps(out)[-1]["rollout/restarts"] == 1
    assert "the fault in detail" in (out / "rlkit.log").read_text()
    assert not left_running(tmp_path.name)


def test_an_engine_lost_while_it_loads_a_deferred_sync_is_restarted_with_that_policy(sft_model, task_data,
                                                                                     tmp_path):
    """Async (max_staleness 1): the learners train on while the engines load the policy, so engine
    1 dying (-9) in its third load is found only when the engines are next used; it is restarted
    and loads the same buckets, and the parity probe after every step (learner vs each engine)
    passes: the restarted engine holds the policy of that step, not model.path's or a later one."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE),
           *grpo_overrides(sft_model, task_data, out, "rollout.num_engines=2", "grpo.steps=4", "eval.every=0",
                           "grpo.max_staleness=1", "rollout.sync_check_every=1", "rollout.sync_check_tol=1e-3")]
    res = subprocess.run(cmd, env=marked_env(tmp_path.name, RLKIT_FAULT="die:weight_sync:engine1:2"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^rlkit: engine 1 died during the weight sync \(pid \d+, .*\); restarted in [\d.]+ s; the "
                     r"weight sync starts over \(restart 1 of rollout.max_restarts \d+\)$", res.stderr, re.M), \
        res.stderr[-3000:]
    steps = run_steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["rollout/restarts"] == 1
    assert all(r["sync/check_abs_diff_max"] <= 1e-3 for r in steps), [r["sync/check_abs_diff_max"] for r in steps]
    assert not left_running(tmp_path.name)


def test_errors_before_launch_are_one_line(task_data, tmp_path):
    base = [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE)]
    missing = subprocess.run(base + grpo_overrides(tmp_path / "nope" / "final", task_data, tmp_path / "o"),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "model.path:" in missing.stderr and "no config.json" in missing.stderr
