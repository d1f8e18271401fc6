"""A run started in an output_dir that holds a run: refused, started over, or resumed with the
changed keys printed (rlkit/run/reruns.py through RunDir)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlkit import stages
from rlkit.errors import UserError
from rlkit.run.reruns import changes, flatten
from rlkit.run.rundir import RunDir
from tests.helpers import GRPO_RECIPE, FakeLearners

SFT_RECIPE = GRPO_RECIPE.parent / "tiny-sft.yaml"


def _open(out: Path, *overrides: str, stage: str = "grpo") -> RunDir:
    recipe = GRPO_RECIPE if stage == "grpo" else SFT_RECIPE
    return RunDir(stages.load(stage, recipe, [f"output_dir={out}", *overrides]), stage)


def _finish(run: RunDir) -> None:
    (run.path / "metrics.jsonl").write_text('{"step": 1}\n')
    run.save_final(FakeLearners(100), "tok")


def test_flatten_and_changes():
    old = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "rewards": [{"fn": "a", "weight": 1}], "overwrite": False}
    new = {"optim": {"lr": 2e-5, "betas": [0.9, 0.99]}, "rewards": [{"fn": "b", "weight": 1}], "overwrite": True}
    assert flatten(old)["optim.betas"] == [0.9, 0.99] and flatten(old)["rewards[0].fn"] == "a"
    assert changes(old, new) == {"optim.lr": (1e-5, 2e-5), "rewards[0].fn": ("a", "b")}


def test_a_finished_run_is_not_replaced_without_overwrite(tmp_path):
    out = tmp_path / "run"
    _finish(_open(out, "checkpoint.every=0"))
    for overrides in ((), ("optim.lr=1e-5",)):
        with pytest.raises(UserError, match=rf"^output_dir: {out} holds a finished run \(final/\); choose another "
                                            r"output_dir, or set overwrite: true to replace it$"):
            _open(out, "checkpoint.every=0", *overrides)
    assert (out / "final" / "model.pt").exists() and (out / "metrics.jsonl").exists()  # nothing lost


def test_overwrite_true_removes_the_previous_outputs(tmp_path, caplog):
    out = tmp_path / "run"
    first = _open(out, "checkpoint.every=1")
    first.checkpoint(7, FakeLearners(100), {"step": 7})
    _finish(first)
    (out / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        run = _open(out, "checkpoint.every=1", "checkpoint.resume=never", "overwrite=true")
    assert run.resume_from is None and run.ckpts.steps() == []
    assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.yaml").exists()
    assert any("overwrite: true: removed final, checkpoints, metrics.jsonl, config.yaml from" in r.message
               for r in caplog.records)


def test_checkpoints_left_unused_by_resume_never_are_refused(tmp_path):
    out = tmp_path / "run"
    _open(out, "checkpoint.every=1").checkpoint(3, FakeLearners(100), {"step": 3})
    with pytest.raises(UserError, match=r"holds checkpoints that checkpoint.resume: never does not resume from; "
                                        r"choose another output_dir, or set overwrite: true"):
        _open(out, "checkpoint.every=1", "checkpoint.resume=never")


def test_another_recipes_unfinished_run_is_refused_and_the_same_one_starts_over(tmp_path, caplog):
    out = tmp_path / "run"
    _open(out, "checkpoint.every=0")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # killed before its first checkpoint
    with pytest.raises(UserError, match=r"holds a run of another recipe \(optim.lr: 0.0001 -> 1e-05\); choose "):
        _open(out, "checkpoint.every=0", "optim.lr=1e-5")
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        _open(out, "checkpoint.every=0", "checkpoint.resume=never")  # resume: never is not a change of recipe
    assert not (out / "metrics.jsonl").exists()
    assert any("holds an unfinished run with no checkpoint: starting it over" in r.message for r in caplog.records)


def test_a_launch_that_stopped_before_its_first_metrics_does_not_block_a_changed_recipe(tmp_path, caplog):
    """A launch that never trained (the cluster had not the resources, a node could not see
    output_dir) leaves only its config: the corrected recipe starts over there."""
    out = tmp_path / "run"
    _open(out, "checkpoint.every=0")
    assert (out / "config.yaml").exists() and not (out / "metrics.jsonl").exists()
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        _open(out, "checkpoint.every=0", "optim.lr=1e-5")
    assert "lr: 1.0e-05" in (out / "config.yaml").read_text()
    assert any("starting it over" in r.message for r in caplog.records)


def test_a_resume_prints_changed_keys_and_refuses_fixed_ones(tmp_path, caplog):
    out = tmp_path / "run"
    _open(out, "checkpoint.every=1", stage="sft").checkpoint(2, FakeLearners(100), {"step": 2})
    assert (out / "checkpoints" / "step-2" / "config.yaml").exists()
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        run = _open(out, "checkpoint.every=1", "optim.lr=1e-4", "train.max_steps=99", stage="sft")
    assert run.resume_from == out / "checkpoints" / "step-2"
    changed = [r.message for r in caplog.records if "with a changed config" in r.message]
    assert changed and changed[0].endswith("with a changed config: optim.lr: 0.003 -> 0.0001; "
                                           "train.max_steps: 1200 -> 99")
    for key, value in (("train.micro_batch_size", 2), ("data.cutoff_len", 16), ("model.path", "/elsewhere"),
                       ("deepspeed.zero_stage", 2)):
        with pytest.raises(UserError, match=rf"^checkpoint.resume: {run.resume_from} was trained with another "
                                            rf"{key}: .* -> .*; these cannot change mid-run: put them back, start "
                                            r"in another output_dir, or set checkpoint.force_resume: true"):
            _open(out, "checkpoint.every=1", f"{key}={value}", stage="sft")
    forced = _open(out, "checkpoint.every=1", "train.micro_batch_size=2", "checkpoint.force_resume=true", stage="sft")
    assert forced.resume_from == run.resume_from


def test_an_explicit_checkpoint_elsewhere_is_compared_with_its_own_config(tmp_path):
    first = _open(tmp_path / "a", "checkpoint.every=1")
    first.checkpoint(1, FakeLearners(100), {"step": 1})
    ckpt = tmp_path / "a" / "checkpoints" / "step-1"
    with pytest.raises(UserError, match=r"^checkpoint.resume: .*step-1 is a checkpoint of `rlkit grpo`, not of "
                                        r"`rlkit sft`: resume from one of this stage \(an SFT model goes in "
                                        r"model.path\)$"):
        _open(tmp_path / "b", f"checkpoint.resume={ckpt}", stage="sft")
    assert _open(tmp_path / "c", f"checkpoint.resume={ckpt}", "eval.every=0").resume_from == ckpt
