"""`deepspeed.config: ds_config.json`: a user's DeepSpeed JSON (in the shape of the seeds') is
folded into the recipe at load: "auto" takes the recipe's value, the file fills what the recipe
leaves unset, a value both set must agree (else one line naming both), the rest reaches
DeepSpeed as is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from rlkit import stages
from rlkit.errors import ConfigError
from rlkit.learner.ds_config import deepspeed_config
from tests.helpers import SEED_002

# seed 004's ds_config.json: ZeRO-3 + CPU offload, "auto" batch sizes, fp16, AdamW, WarmupDecayLR
SEED_004 = {
    "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 1000}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "contiguous_gradients": True, "overlap_comm": True},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False}, "gradient_clipping": 1.0, "steps_per_print": 50}
# seed 001's dict: ZeRO-2 with offload_param, which only ZeRO-3 has
SEED_001 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}, "fp16": {"enabled": True}}

def recipe(tmp_path, ds_file, sections=None, stage="sft"):
    """A recipe naming ds_config.json (written from `ds_file`); `sections` add or replace keys."""
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_file))
    data = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "output_dir": "out",
            "deepspeed": {"config": "ds_config.json"}}
    if stage == "grpo":
        data["rewards"] = [{"fn": "rewards.exact:exact_match"}]
    for section, keys in (sections or {}).items():
        data[section] = {**data.get(section, {}), **keys}
    r = tmp_path / f"{stage}.yaml"
    r.write_text(yaml.safe_dump(data))
    return r


def test_seed_004_config_fills_the_recipe(tmp_path):
    cfg = stages.load("sft", recipe(tmp_path, SEED_004, {"train": {"micro_batch_size": 2, "grad_accum": 4}}))
    ds, o = cfg.deepspeed, cfg.optim
    assert (ds.zero_stage, ds.offload_optimizer, ds.offload_param, cfg.model.dtype) == (3, True, True, "fp16")
    assert (o.lr, o.weight_decay, o.scheduler, o.warmup_steps, o.min_lr_ratio, o.max_grad_norm) == \
        (2e-5, 0.0, "linear", 1000, 0.0, 1.0)
    out = deepspeed_config(ds, o, "fp16", cfg.train.micro_batch_size, cfg.train.grad_accum, 2)
    z = out["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and z["overlap_comm"] is True
    assert out["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                           "hysteresis": 2, "min_loss_scale": 1}
    assert out["steps_per_print"] == 50 and out["train_batch_size"] == 16    # "auto": 2 x 4 x 2 learners
    assert "scheduler" not in out and "optimizer" not in out                  # rlkit builds both from optim.*


def test_auto_takes_the_recipe_and_auto_only_keys_are_left_to_deepspeed(tmp_path):
    cfg = stages.load("grpo", recipe(tmp_path, SEED_002, {"model": {"dtype": "bf16"}}, "grpo"),
                      ["optim.max_grad_norm=0.5"])
    assert cfg.deepspeed.zero_stage == 3 and cfg.model.dtype == "bf16" and cfg.optim.max_grad_norm == 0.5
    z = cfg.deepspeed.extra["zero_optimization"]
    assert z == {"overlap_comm": True, "contiguous_gradients": True, "stage3_gather_16bit_weights_on_model_save": True}


@pytest.mark.parametrize("ds_file, sections, message", [
    (SEED_004, {"deepspeed": {"zero_stage": 2}},
     "ds_config.json: zero_optimization.stage is 3 but the recipe sets deepspeed.zero_stage: 2; remove one"),
    (SEED_004, {"optim": {"lr": 1e-4}}, "optimizer.params.lr is 2e-05 but the recipe sets optim.lr: 0.0001"),
    (SEED_004, {"model": {"dtype": "bf16"}},
     "fp16.enabled / bf16.enabled is 'fp16' but the recipe sets model.dtype: 'bf16'"),
    ({**SEED_002, "train_batch_size": 64}, {"train": {"micro_batch_size": 2, "grad_accum": 4, "num_learners": 2}},
     "train_batch_size is 64 but the recipe gives 16 (train.micro_batch_size, grad_accum, num_learners: micro-batch "
     "2 x accumulation 4 x learners 2); set it to \"auto\" or 16"),
    ({**SEED_002, "train_micro_batch_size_per_gpu": 4}, {"train": {"micro_batch_size": 2}},
     "train_micro_batch_size_per_gpu is 4 but the recipe sets train.micro_batch_size: 2"),
    (SEED_001, {}, "zero_optimization.offload_param needs stage 3, the config is at stage 2"),
    ({"optimizer": {"type": "Lamb"}}, {}, "optimizer.type 'Lamb': rlkit trains with AdamW"),
    ({"scheduler": {"type": "OneCycle"}}, {}, "scheduler.type 'OneCycle' is not one rlkit maps"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, "bf16.enabled and fp16.enabled are both true"),
    ({**SEED_004, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}, {},
     "scheduler.params.warmup_max_lr is 2e-05 but optimizer.params.lr is 1e-05; both set optim.lr: make them agree"),
])
def test_conflicts_are_one_line_naming_both(tmp_path, ds_file, sections, message):
    with pytest.raises(ConfigError) as e:
        stages.load("sft", recipe(tmp_path, ds_file, sections))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_file_fills_only_what_is_unset_and_values_that_agree_pass(tmp_path):
    cfg = stages.load("sft", recipe(tmp_path, SEED_004, {"optim": {"lr": 2e-5, "warmup_steps": 1000},
                                                         "deepspeed": {"zero_stage": 3}}))
    assert cfg.optim.lr == 2e-5 and cfg.deepspeed.offload_param
    # GRPO derives its accumulation: a file that states it must match what the recipe gives
    r = recipe(tmp_path, {**SEED_002, "gradient_accumulation_steps": 3}, {}, "grpo")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is 3 but the recipe gives"):
        stages.load("grpo", r)


def test_cli_reports_a_missing_or_broken_file_in_one_line(tmp_path):
    r = recipe(tmp_path, {})
    r.write_text(r.read_text().replace("ds_config.json", "nope.json"))
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", str(r), "--print-config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "deepspeed.config: cannot read nope.json" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}')
    r.write_text(r.read_text().replace("nope.json", "bad.json"))
    with pytest.raises(ConfigError, match=r"bad.json: line 1: invalid JSON"):
        stages.load("sft", r)
