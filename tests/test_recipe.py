"""Recipes -> typed configs: overrides, types, unknown keys, keys another stage reads, stage
mismatch; every mistake is one line naming the file and the key (exit 2 from the CLI)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import stages
from rlkit.errors import ConfigError
from rlkit.recipe import parse_overrides
from tests.helpers import GRPO_BASE

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_overrides_apply_and_parse_types():
    cfg = stages.load("sft", RECIPES / "tiny-sft.yaml",
                      ["optim.lr=1e-4", "train.max_steps=7", "finetuning=lora", "lora.r=4",
                       "lora.target_modules=q_proj,v_proj"])
    assert cfg.optim.lr == 1e-4 and cfg.train.max_steps == 7
    assert cfg.lora.r == 4 and cfg.lora.target_modules == ("q_proj", "v_proj")
    assert parse_overrides(["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


def test_configs_are_frozen():
    cfg = stages.load("sft", RECIPES / "tiny-sft.yaml")
    with pytest.raises(AttributeError):
        cfg.optim.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("override, expected", [
    ("train.micro_batch_sz=3", "tiny-sft.yaml: train.micro_batch_sz: unknown key (did you mean 'micro_batch_size'?)"),
    ("train.micro_batch_size=abc", "tiny-sft.yaml: train.micro_batch_size: expected an integer, got str 'abc'"),
    ("deepspeed.offload_param=true", "tiny-sft.yaml: deepspeed.offload_param: needs zero_stage: 3"),
    ("finetuning=qlora", "tiny-sft.yaml: lora: finetuning: qlora needs a lora section"),
    ("lora.r=0", "tiny-sft.yaml: lora.r: LoRA rank must be > 0, got 0"),
    ("curriculum.phases=[{until: 0.5, mix: [1, 0, 0]}]", "curriculum.phases: the last phase must end at until: 1.0"),
    ("curriculum.phases=[{until: 1.0, mix: [0.5, 0.5]}]", "curriculum.phases[0].mix: needs one share per level"),
    ("data.eval=null", "tiny-sft.yaml: eval.every: evaluates on data.eval every 200 steps, but data.eval is not set"),
    ("model.tiny=tiny", "tiny-sft.yaml: model.tiny: renamed: use 'build_tiny_if_missing'"),
    ("data.synthetic_seed=0", "tiny-sft.yaml: data.synthetic_seed: renamed: use 'build_synthetic_if_missing'"),
])
def test_cli_user_errors_are_one_line_exit_2(override, expected):
    recipe = RECIPES / "tiny-sft.yaml"
    extra = ["finetuning=lora"] if override.startswith("lora.") else []
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", str(recipe), override, *extra, "--print-config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert expected in lines[0] and "Traceback" not in out.stderr


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        stages.load("sft", tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ not valid YAML"):
        stages.load("sft", bad)


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lr: 1.0e-4\n  scheduler: cosine\n  lr: 1.0e-5\n", "optim.lr is given twice (lines 2 and 4)"),
    ("output_dir: a\nseed: 1\noutput_dir: b\n", "output_dir is given twice (lines 1 and 3)"),
    ("rewards:\n  - {fn: 'a:b', weight: 1, fn: 'c:d'}\n", "rewards[0].fn is given twice (lines 2 and 2)"),
])
def test_a_key_given_twice_is_an_error(tmp_path, text, message):
    """YAML keeps the last of two equal keys silently: a setting that "did nothing"."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: {message}; the second would silently win")):
        stages.load("grpo", recipe)


def test_eval_every_needs_eval_data_in_both_stages():
    for stage in ("sft", "grpo"):
        with pytest.raises(ConfigError, match=r"eval.every: evaluates on data.eval every 5 steps, but data.eval "
                                              r"is not set: add data.eval \(held-out rows\) or set eval.every: 0"):
            stages.load(stage, RECIPES / f"tiny-{stage}.yaml", ["data.eval=null", "eval.every=5"])
        assert stages.load(stage, RECIPES / f"tiny-{stage}.yaml", ["data.eval=null", "eval.every=0"]).eval.every == 0


def test_required_key_and_stage_mismatch(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("stage: sft\noutput_dir: x\nmodel: {path: m}\n")
    with pytest.raises(ConfigError, match=r"r.yaml: data: required key is missing"):
        stages.load("sft", r)
    r.write_text("stage: grpo\n")
    with pytest.raises(ConfigError, match="this recipe is for 'grpo', not 'sft'"):
        stages.load("sft", r)


@pytest.mark.parametrize("stage, override, message", [
    ("grpo", "data.cutoff_len=512", "data.cutoff_len: this stage does not read it (SFT only: GRPO prompts are not cut"),
    ("grpo", "data.packing=true", "data.packing: this stage does not read it (SFT only"),
    ("grpo", "eval.patience=3", "eval.patience: this stage does not read it (SFT only: GRPO does not stop early)"),
    ("grpo", "eval.max_batches=3", "eval.max_batches: this stage does not read it (SFT only"),
    ("sft", "eval.temperature=0", "eval.temperature: this stage does not read it (GRPO only"),
    ("sft", "eval.samples_per_prompt=2", "eval.samples_per_prompt: this stage does not read it (GRPO only"),
])
def test_a_key_the_stage_does_not_read_is_an_error(tmp_path, stage, override, message):
    r = tmp_path / "r.yaml"
    sft = "stage: sft\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
    r.write_text(GRPO_BASE if stage == "grpo" else sft)
    with pytest.raises(ConfigError) as e:
        stages.load(stage, r, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_stage_defaults_apply_field_by_field(stage, tmp_path):
    """Setting one key of a section changes that key only: every key of every section, set to
    its stage default on its own (and the section set to null), gives the stage's default
    section. (GRPO's optim defaults, lr 1e-6 and a constant schedule, used to vanish as soon as
    any optim key was set.)"""
    import dataclasses

    import yaml

    from rlkit.recipe import to_dict

    base = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "output_dir": "out"}
    if stage == "grpo":
        base["rewards"] = [{"fn": "rewards.exact:exact_match"}]
    r = tmp_path / "r.yaml"
    r.write_text(yaml.safe_dump(base))
    default = stages.load(stage, r)
    checked = 0
    for f in dataclasses.fields(default):
        section = getattr(default, f.name)
        if not dataclasses.is_dataclass(section) or f.default_factory is dataclasses.MISSING:
            continue
        want = to_dict(section)
        for sub, value in want.items():
            r.write_text(yaml.safe_dump({**base, f.name: {sub: value}}))
            assert to_dict(getattr(stages.load(stage, r), f.name)) == want, f"{f.name}.{sub}"
            checked += 1
        r.write_text(yaml.safe_dump({**base, f.name: None}))
        assert to_dict(getattr(stages.load(stage, r), f.name)) == want, f"{f.name}: null"
    assert checked > 30
    if stage == "grpo":  # the case that was wrong
        cfg = stages.load(stage, r, ["optim.lr=2e-6"])
        assert (cfg.optim.lr, cfg.optim.scheduler) == (2e-6, "constant")
