"""`rlkit export`: what it refuses, each in one line (the weights themselves: tests/e2e/test_sft.py,
which exports every checkpoint of full, LoRA, QLoRA, ZeRO-2 and ZeRO-3 runs and compares with final/)."""

from __future__ import annotations

import pytest

from rlkit.commands.export import export_checkpoint
from rlkit.errors import UserError
from tests.helpers import FakeLearners, grpo_run_dir


def test_export_refuses_what_is_not_an_intact_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checkpoint's relative model.path resolves here, not in the checkout
    with pytest.raises(UserError, match=r"not an rlkit checkpoint \(no rlkit_state.json\); name a checkpoints/step-N"):
        export_checkpoint(tmp_path, tmp_path / "out")
    run = grpo_run_dir(tmp_path / "run")
    run.checkpoint(3, FakeLearners(1000), {"step": 3})
    ckpt = run.ckpts.root / "step-3"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(UserError, match=r"^--out: .*full exists and is not empty; choose a new folder$"):
        export_checkpoint(ckpt, tmp_path / "full")
    with pytest.raises(UserError, match=r"^model.path \(from the checkpoint's config.yaml\): runs/tiny-sft/final is "
                                        r"not a model directory"):
        export_checkpoint(ckpt, tmp_path / "out")  # the tiny recipe's model was never built here
    with open(ckpt / "mp_rank_00_model_states.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(UserError, match=r"the checkpoint is damaged \(mp_rank_00_model_states.pt has \d+ bytes, the "
                                        r"manifest says \d+\); export another one"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and (tmp_path / "full" / "x").read_text() == "mine"
