"""kill -9 in the middle of `rlkit sft`, then `resume: auto`: same weights and loss curve as a clean run;
a full disk at a checkpoint: one line, the last checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from rlkit.checkpoint import verify
from tests.conftest import left_running, marked_env
from tests.sft.conftest import ROOT, read_metrics, sft_overrides

pytestmark = pytest.mark.slow


def _cmd(tiny_model, task_data, out):
    return [sys.executable, "-m", "rlkit.cli", "sft", str(ROOT / "recipes" / "tiny-sft.yaml"),
            *sft_overrides(tiny_model, task_data, out, "train.max_steps=24", "checkpoint.every=6",
                           "checkpoint.keep_last=2", "eval.every=12", "optim.warmup_steps=4",
                           "logging.progress=plain")]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}


def test_kill9_then_resume_matches_uninterrupted(tiny_model, task_data, tmp_path):
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    done = subprocess.run(_cmd(tiny_model, task_data, clean), env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(_cmd(tiny_model, task_data, broken), env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (broken / "checkpoints" / "step-12").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline, "no checkpoint at step 12 within 300 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    proc.wait()
    assert not (broken / "final").exists()

    resumed = subprocess.run(_cmd(tiny_model, task_data, broken), env=_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert "steps per epoch; 24 steps (" in resumed.stderr  # the run's plan, before it starts

    a, b = load_file(clean / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-6, name
    curve = lambda run: [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in read_metrics(run)]  # noqa: E731
    ca, cb = curve(clean), curve(broken)
    assert [s for s, *_ in cb] == list(range(0, 25)), "resumed log must have each step once"
    for (sa, la, ea), (sb, lb, eb) in zip(ca, cb):
        assert sa == sb and la == pytest.approx(lb, abs=1e-6) and ea == pytest.approx(eb, abs=1e-6)


def test_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last(tiny_model, task_data, tmp_path):
    """The learner's checkpoint write fails with ENOSPC at step 2: one line naming the path and
    the bytes it needs, exit 2, checkpoint step-1 intact, no half one left, no process left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlkit.cli", "sft", str(ROOT / "recipes" / "tiny-sft.yaml"),
           *sft_overrides(tiny_model, task_data, out, "train.max_steps=4", "checkpoint.every=1", "eval.every=0",
                          "logging.progress=none")]
    res = subprocess.run(cmd, env=marked_env(tmp_path.name, RLKIT_FAULT="enospc:learner0:1"), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1].startswith(
        f"rlkit: error: checkpoint step 2: the disk is full under {out / 'checkpoints'} (it needs about "), res.stderr
    assert "free): free some space; the newest checkpoint, step-1, is intact: rerun" in res.stderr
    assert "Traceback" not in res.stderr
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"] and verify(ckpts / "step-1") is None
    assert not (out / "final").exists() and not left_running(tmp_path.name)
