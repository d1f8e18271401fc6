"""Recipes: every shipped YAML loads; user mistakes give one line on stderr and exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import config
from rlkit.errors import ConfigError
from rlkit.recipe import parse_overrides

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def _stage(path: Path) -> str:
    import yaml

    return yaml.safe_load(path.read_text())["stage"]


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path):
    cfg = config.load(_stage(path), path)
    assert cfg.output_dir


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny-sft.yaml", "opt-6.7b-lora.yaml", "qwen32b-npu-zero3.yaml", "llama7b-zero3-offload.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_print_config_round_trips(path, tmp_path):
    """--print-config prints YAML that loads back into the same config."""
    stage = _stage(path)
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", stage, str(path), "--print-config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    again = tmp_path / "resolved.yaml"
    again.write_text(out.stdout)
    assert config.load(stage, again) == config.load(stage, path)


def test_overrides_apply_and_parse_types():
    cfg = config.load("sft", RECIPES[0].parent / "tiny-sft.yaml",
                      ["optim.lr=1e-4", "train.max_steps=7", "finetuning=lora", "lora.r=4",
                       "lora.target_modules=q_proj,v_proj"])
    assert cfg.optim.lr == 1e-4 and cfg.train.max_steps == 7
    assert cfg.lora.r == 4 and cfg.lora.target_modules == ("q_proj", "v_proj")
    assert parse_overrides(["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


def test_configs_are_frozen():
    cfg = config.load("sft", RECIPES[0].parent / "tiny-sft.yaml")
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
])
def test_cli_user_errors_are_one_line_exit_2(override, expected):
    recipe = RECIPES[0].parent / "tiny-sft.yaml"
    extra = ["finetuning=lora"] if override.startswith("lora.") else []
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", str(recipe), override, *extra, "--print-config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert expected in lines[0] and "Traceback" not in out.stderr


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        config.load("sft", tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ not valid YAML"):
        config.load("sft", bad)


def test_required_key_and_stage_mismatch(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("stage: sft\noutput_dir: x\nmodel: {path: m}\n")
    with pytest.raises(ConfigError, match=r"r.yaml: data: required key is missing"):
        config.load("sft", r)
    r.write_text("stage: grpo\n")
    with pytest.raises(ConfigError, match="this recipe is for 'grpo', not 'sft'"):
        config.load("sft", r)


def test_grpo_cross_field_rules(tmp_path):
    base = ("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
            "rewards: [{fn: 'rewards.exact:exact_match'}]\n")
    r = tmp_path / "g.yaml"
    r.write_text(base)
    assert config.load("grpo", r).grpo.group_size == 8
    with pytest.raises(ConfigError, match="grpo.group_size: group-relative advantages need >= 2, got 1"):
        config.load("grpo", r, ["grpo.group_size=1"])
    with pytest.raises(ConfigError, match="grpo.micro_batch_size: a mini-batch of 64 completions does not divide"):
        config.load("grpo", r, ["grpo.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].fn: expected 'module.path:function'"):
        config.load("grpo", r, ["rewards=[{fn: nocolon}]"])


def test_grpo_placement_and_sync_rules(tmp_path):
    from rlkit.accel import detect
    from rlkit.engine.engines import sync_strategy
    from rlkit.errors import UserError

    r = tmp_path / "g.yaml"
    r.write_text("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
                 "rewards: [{fn: 'rewards.exact:exact_match'}]\n")
    cpu = detect("cpu")
    assert sync_strategy(config.load("grpo", r).rollout, cpu) == "object_store"
    colocated = config.load("grpo", r, ["rollout.colocate=true", "grpo.num_learners=2", "rollout.num_engines=2",
                                        "grpo.micro_batch_size=4"])
    assert sync_strategy(colocated.rollout, cpu) == "in_process"
    with pytest.raises(ConfigError, match=r"rollout.num_engines: colocated engines are one per learner: set it to "
                                          r"grpo.num_learners \(1\)"):
        config.load("grpo", r, ["rollout.colocate=true", "rollout.num_engines=2"])
    with pytest.raises(ConfigError, match="grpo.async_generation: colocated engines share the learners' processes"):
        config.load("grpo", r, ["rollout.colocate=true", "grpo.async_generation=true"])
    with pytest.raises(ConfigError, match="rollout.sync: in_process sync needs colocate: true"):
        config.load("grpo", r, ["rollout.sync=in_process"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size: colocated engines are one replica"):
        config.load("grpo", r, ["rollout.colocate=true", "rollout.tensor_parallel_size=2"])
    with pytest.raises(UserError, match="rollout.sync: broadcast needs NCCL/HCCL between devices, but rlkit runs on cpu"):
        sync_strategy(config.load("grpo", r, ["rollout.sync=broadcast"]).rollout, cpu)
    with pytest.raises(ConfigError, match="eval.samples_per_prompt: must be >= 1, got 0"):
        config.load("grpo", r, ["eval.samples_per_prompt=0"])
