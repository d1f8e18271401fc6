"""`scripts/kill_anywhere.py` with two kill points: the whole run killed (-9) mid-sync (GRPO) and
mid-checkpoint (SFT), each rerun to the same per-step rewards / losses and bit-identical
weights as a run never killed. The full harness (12 points) is in the issue-11 note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_runs_killed_mid_sync_and_mid_checkpoint_resume_bit_identically(sft_model, task_data, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "kill_anywhere.py"), "--model", str(sft_model),
                          "--data", str(Path(task_data["sft_train"]).parent), "--points", "2", "--stages", "grpo",
                          "sft", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    grpo = next(x for x in lines if x.startswith("grpo halt:weight_sync:engine0:"))
    sft = next(x for x in lines if x.startswith("sft halt:checkpoint:driver:"))
    # (seed 0 draws the 7th sync and the 4th checkpoint: each rerun resumes from a checkpoint)
    assert "killed (exit -9)" in grpo and "resumed at step" in grpo and grpo.endswith("bit-identical"), grpo
    # the checkpoint being written was left half-written, and the rerun resumed from the one before
    assert "killed (exit -9)" in sft and "half-written" in sft and "resumed at step" in sft, sft
    assert sft.endswith("bit-identical"), sft
    assert lines[-1] == "kill anywhere: 2 kill points, 2 resumed bit-identically (grpo 1/1, sft 1/1)"
