"""A recipe's paths resolve once, against the folder where rlkit runs, before any actor gets them
(actors work in their raylet's folder): what stays as written (hub ids, `auto`), what a run's
config.yaml then holds, and that a run started with relative paths still resumes. The two-host
run with a relative output_dir: tests/e2e/test_multinode.py."""

from __future__ import annotations

import os

from rlkit import stages
from rlkit.paths import absolute_paths
from tests.helpers import ROOT


def test_paths_are_made_absolute_and_hub_ids_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    tree = {"output_dir": "runs/x", "model": {"path": "Qwen/Qwen2.5-1.5B", "tokenizer": "models/tok"},
            "data": {"train": "~/d/train.jsonl", "eval": None}, "checkpoint": {"resume": "auto"},
            "distill": {"teacher": {"path": "models/teacher"}}}
    out = absolute_paths(tree)
    assert out == {"output_dir": str(tmp_path / "runs" / "x"),
                   "model": {"path": "Qwen/Qwen2.5-1.5B", "tokenizer": str(tmp_path / "models" / "tok")},
                   "data": {"train": os.path.expanduser("~/d/train.jsonl"), "eval": None},
                   "checkpoint": {"resume": "auto"},
                   "distill": {"teacher": {"path": str(tmp_path / "models" / "teacher")}}}
    assert absolute_paths(out) == out and tree["output_dir"] == "runs/x"  # idempotent; the input is left alone
    assert absolute_paths({"checkpoint": {"resume": "runs/x/checkpoints/step-4"}}) == {
        "checkpoint": {"resume": str(tmp_path / "runs" / "x" / "checkpoints" / "step-4")}}


def test_the_run_gets_absolute_paths_and_a_relative_config_yaml_still_resumes(tmp_path, monkeypatch, tiny_model,
                                                                              task_data):
    from rlkit.accel import detect
    from rlkit.recipe import to_dict
    from rlkit.run.driver import prepare_inputs
    from rlkit.run.reruns import changes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").symlink_to(tiny_model)
    overrides = ["model.path=model", "model.build_tiny_if_missing=null", f"data.train={task_data['sft_train']}",
                 "data.eval=null", "eval.every=0", "data.build_synthetic_if_missing=null", "output_dir=runs/rel"]
    cfg = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", overrides)
    assert cfg.output_dir == "runs/rel"  # the recipe as written, until the run prepares it
    run = prepare_inputs(cfg, detect("cpu"), "sft")
    assert run.output_dir == str(tmp_path / "runs" / "rel") and run.model.path == str(tmp_path / "model")
    # a config.yaml written with the relative spelling (by rlkit before this) compares equal
    assert changes(to_dict(cfg), to_dict(run)) == {}
    moved = to_dict(stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", [*overrides, "output_dir=runs/other"]))
    assert set(changes(moved, to_dict(run))) == {"output_dir"}
