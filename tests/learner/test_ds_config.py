"""The DeepSpeed config builder and the learning-rate schedule, against hand-computed values."""

import math

import pytest

from rlkit.config import DeepSpeedConfig, OptimConfig
from rlkit.learner.ds_config import deepspeed_config, learner_clips, lr_lambda, warmup_steps


@pytest.mark.parametrize("scheduler, at, want", [
    # 4 warmup steps of 20: (s + 1) / 5 while warming up; then 16 steps of decay to min 0.1.
    ("cosine", 0, 1 / 5), ("cosine", 3, 4 / 5),
    ("cosine", 4, 1.0), ("cosine", 12, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))), ("cosine", 20, 0.1),
    ("linear", 4, 1.0), ("linear", 12, 0.1 + 0.9 * 0.5), ("linear", 20, 0.1), ("linear", 30, 0.1),
    ("constant", 2, 3 / 5), ("constant", 19, 1.0),
])
def test_lr_schedule_by_hand(scheduler, at, want):
    optim = OptimConfig(scheduler=scheduler, warmup_steps=4, min_lr_ratio=0.1)
    assert lr_lambda(optim, total_steps=20)(at) == pytest.approx(want)


def test_warmup_from_ratio():
    assert warmup_steps(OptimConfig(warmup_ratio=0.1), 95) == 10  # round(9.5) (banker's) -> 10
    assert warmup_steps(OptimConfig(warmup_steps=7), 95) == 7
    assert lr_lambda(OptimConfig(scheduler="cosine"), 10)(0) == 1.0  # no warmup: peak at once


def test_deepspeed_config_sections():
    optim = OptimConfig(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5)
    z0 = deepspeed_config(DeepSpeedConfig(zero_stage=0), optim, "fp32", micro_batch_size=4, grad_accum=2, world_size=3)
    assert z0["train_batch_size"] == 4 * 2 * 3 and z0["gradient_accumulation_steps"] == 2
    assert z0["zero_optimization"] == {"stage": 0}
    # ZeRO-0 fp32: rlkit clips (and reports the norm) itself, DeepSpeed must not clip again.
    assert learner_clips(DeepSpeedConfig(zero_stage=0), "fp32") and z0["gradient_clipping"] == 0.0
    assert "optimizer" not in z0 and z0["zero_force_ds_cpu_optimizer"] is False  # torch AdamW by default
    assert not z0["bf16"]["enabled"] and not z0["fp16"]["enabled"]

    z3 = deepspeed_config(DeepSpeedConfig(zero_stage=3, offload_optimizer=True, offload_param=True, torch_adam=False,
                                          extra={"zero_optimization": {"overlap_comm": True}, "steps_per_print": 50}),
                          optim, "bf16", 2, 8, 4)
    zero = z3["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["overlap_comm"] is True and z3["steps_per_print"] == 50  # `extra` is merged last, deeply
    assert zero["stage3_gather_16bit_weights_on_model_save"] and zero["contiguous_gradients"]
    assert z3["gradient_clipping"] == 0.5 and z3["bf16"]["enabled"]  # DeepSpeed clips there
    assert z3["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.1}}
    assert deepspeed_config(DeepSpeedConfig(zero_stage=2), optim, "fp16", 1, 1, 1)["fp16"]["enabled"]


def test_zero3_on_one_learner_is_one_line():
    """Stage 3 on one learner without offload partitions nothing: a line; none with two learners,
    or with an offload (which does move memory off the device)."""
    from rlkit.learner.ds_config import zero3_alone

    line = zero3_alone(DeepSpeedConfig(zero_stage=3), 1)
    assert line and "zero_stage: 3 with one learner" in line and "use zero_stage 0" in line
    assert zero3_alone(DeepSpeedConfig(zero_stage=3), 2) is None
    assert zero3_alone(DeepSpeedConfig(zero_stage=3, offload_param=True), 1) is None
    assert zero3_alone(DeepSpeedConfig(zero_stage=2), 1) is None
