"""SFT of a vision-language model in seed 001's shape, for real (Ray, DeepSpeed on gloo): the
vision tower and projector frozen (the defaults), the language model trained, on two ZeRO-3
learners, which partition the frozen weights with the rest. The final model's vision weights are
the starting ones byte for byte, its language model's are not, and the loss fell. The tiny VLM
task's accuracy (SFT, then GRPO, against a text-only model) is `tests/grpo/test_vlm_grpo.py`."""

from __future__ import annotations

import json

import pytest
import torch

from tests.docs import run_rlkit
from tests.helpers import ROOT

pytestmark = pytest.mark.slow



def test_zero3_learners_train_the_language_model_and_keep_the_frozen_vision_side(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    res = run_rlkit("rlkit sft recipes/tiny-vlm-sft.yaml", tmp_path, extra=(
        "model.freeze_vision_tower=true", "model.freeze_multi_modal_projector=true", "deepspeed.zero_stage=3",
        "train.num_learners=2", "train.micro_batch_size=8", "train.max_steps=8", "eval.every=0",
        "checkpoint.every=0", "output_dir=runs/zero3", "logging.tensorboard=false", "logging.every=1"))
    assert res.returncode == 0, res.stderr[-3000:]
    before = load_file(tmp_path / "runs" / "tiny-vlm" / "model" / "model.safetensors")
    after = load_file(tmp_path / "runs" / "zero3" / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(".vision_model." in k for k in before) and any(".connector." in k for k in before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".text_model." in k or k.startswith("lm_head") for k in changed), sorted(changed)[:5]
    losses = [json.loads(x)["train/loss"] for x in (tmp_path / "runs/zero3/metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
