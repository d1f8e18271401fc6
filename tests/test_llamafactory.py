"""A LLaMA-Factory training recipe read as it is (`rlkit/llamafactory.py`): its flat keys become
rlkit's, its own machinery's keys are named in one warning, and a key whose meaning rlkit cannot
keep is one line naming it (the run: tests/e2e/test_dpo.py)."""

from __future__ import annotations

import logging

import pytest
import yaml

from rlkit import stages
from rlkit.errors import ConfigError
from tests.helpers import ROOT

LF_DPO = ROOT / "recipes" / "llamafactory" / "tiny_lora_dpo.yaml"


def test_llamafactorys_dpo_example_reads_as_rlkits_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        cfg = stages.load("dpo", LF_DPO)
    assert (cfg.model.path, cfg.model.dtype, cfg.model.trust_remote_code) == ("runs/tiny-sft/final", "fp32", True)
    assert cfg.finetuning == "lora" and cfg.lora.r == 8 and cfg.lora.alpha == 16 and cfg.lora.dropout == 0.0
    assert cfg.lora.target_modules == ("all-linear",)  # lora_target: all
    assert (cfg.dpo.loss_type, cfg.dpo.beta) == (("sigmoid",), 0.1)
    assert (cfg.data.train, cfg.data.dataset, cfg.data.template, cfg.data.cutoff_len) == (
        "runs/tiny/data/dataset_info.json", "tiny_dpo_train", "alpaca", 64)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.train.epochs) == (16, 1, 2.0)
    assert (cfg.optim.lr, cfg.optim.scheduler, cfg.optim.warmup_ratio) == (2e-3, "cosine", 0.1)
    assert (cfg.logging.every, cfg.checkpoint.every, cfg.output_dir) == (10, 500, "runs/tiny-lora-dpo")
    (line,) = [r.getMessage() for r in caplog.records if "LLaMA-Factory recipe" in r.getMessage()]
    assert line.endswith("left out (LLaMA-Factory's own machinery): do_train, overwrite_cache, "
                         "preprocessing_num_workers, dataloader_num_workers, plot_loss, overwrite_output_dir, "
                         "save_only_model, report_to, ddp_timeout")


@pytest.mark.parametrize("change, loss, weights, extra", [
    ({"pref_ftx": 0.5}, ("sigmoid", "sft"), (1.0, 0.5), {}),  # RPO
    ({"pref_loss": "simpo", "simpo_gamma": 1.0}, ("simpo",), None, {"cpo_alpha": 0.0, "simpo_gamma": 1.0}),
    ({"pref_loss": "orpo"}, ("orpo",), None, {}),
    ({"finetuning_type": "full", "quantization_bit": None}, ("sigmoid",), None, {"finetuning": "full"}),
    ({"quantization_bit": 4, "bf16": True}, ("sigmoid",), None, {"finetuning": "qlora"}),
])
def test_each_preference_loss_and_method_is_trls_name(tmp_path, change, loss, weights, extra):
    recipe = {**yaml.safe_load(LF_DPO.read_text()), **change}
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if v is not None}))
    cfg = stages.load("dpo", path)
    assert cfg.dpo.loss_type == loss and cfg.dpo.loss_weights == weights
    for key, value in extra.items():
        assert (getattr(cfg, key) if key == "finetuning" else getattr(cfg.dpo, key)) == value
    if cfg.finetuning == "qlora":
        assert cfg.qlora.compute_dtype == "bf16" and cfg.model.dtype == "bf16"


@pytest.mark.parametrize("change, message", [
    ({"dataset": "a,b"}, "dataset: name one dataset_info.json entry (got 2)"),
    ({"val_size": 0.1}, "val_size: rlkit holds out a file of its own"),
    ({"finetuning_type": "freeze"}, "finetuning_type: rlkit trains full, lora or qlora"),
    ({"pref_loss": "kto_pair"}, "pref_loss: kto_pair is not one of TRL's DPO losses: run rlkit kto"),
    ({"stage": "ppo"}, "stage: 'ppo': rlkit trains the stages sft, dpo, rm and kto"),
    ({"quantization_bit": 8}, "quantization_bit: rlkit's QLoRA is 4-bit"),
    ({"quantization_bit": 4, "quantization_method": "gptq"}, "quantization_method: 'gptq': rlkit's QLoRA quantises "
                                                             "with bitsandbytes"),
    ({"max_samples": 1000}, "max_samples: rlkit reads every row"),
    ({"pref_loss": "orpo", "pref_ftx": 0.1}, "pref_ftx: ORPO always trains the chosen side's NLL"),
    ({"mask_history_x": True}, "mask_history_x: not a LLaMA-Factory key rlkit reads"),
])
def test_a_key_rlkit_cannot_keep_is_one_line_naming_it(tmp_path, change, message):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(LF_DPO.read_text()), **change}))
    with pytest.raises(ConfigError) as e:
        stages.load("dpo", path)
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)
