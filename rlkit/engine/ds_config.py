"""DeepSpeed config and learning-rate schedule from the typed recipe (pure; no DeepSpeed import)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rlkit.config import DeepSpeedConfig, OptimConfig
from rlkit.recipe import merge


def deepspeed_config(ds: DeepSpeedConfig, optim: OptimConfig, dtype: str, micro_batch_size: int,
                     grad_accum: int, world_size: int) -> dict[str, Any]:
    """The JSON-able config passed to `deepspeed.initialize`; `ds.extra` is merged last.

    `dtype` is the training precision: "bf16", "fp16" or "fp32". The optimizer and scheduler are
    built by rlkit (torch AdamW + LambdaLR) unless `torch_adam` is false, in which case DeepSpeed
    builds its own (fused) AdamW from the "optimizer" section.
    """
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=False)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if ds.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": 0.0 if learner_clips(ds, dtype) else optim.max_grad_norm,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    }
    if ds.torch_adam:
        # A torch optimizer under ZeRO-Offload: allowed, slower than DeepSpeedCPUAdam but no JIT build.
        cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}}
    return merge(cfg, ds.extra)


def learner_clips(ds: DeepSpeedConfig, dtype: str) -> bool:
    """At ZeRO-0 in fp32 DeepSpeed clips without reporting the norm: rlkit clips there itself
    (one norm computation, which it also logs). Elsewhere DeepSpeed's optimizer clips and reports."""
    return ds.zero_stage == 0 and dtype == "fp32"


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    return optim.warmup_steps or int(round(optim.warmup_ratio * total_steps))


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step `s` (0-based): linear warmup, then decay.

    cosine: min + (1-min) * 0.5 * (1 + cos(pi * progress)); linear: min + (1-min) * (1 - progress);
    constant: 1. `min` is `optim.min_lr_ratio`; progress runs 0..1 over the post-warmup steps.
    """
    warm = warmup_steps(optim, total_steps)
    floor = optim.min_lr_ratio

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if optim.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        if optim.scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1.0 - progress)

    return fn
