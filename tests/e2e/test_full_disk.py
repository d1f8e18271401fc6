"""A full disk at a checkpoint: one line, the last checkpoint intact. (kill -9 of a whole SFT run
mid-checkpoint, then `resume: auto`: tests/e2e/test_kill_anywhere.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlkit.run.checkpoint import verify
from tests.conftest import left_running, marked_env
from tests.helpers import ROOT, sft_overrides

pytestmark = pytest.mark.slow


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
