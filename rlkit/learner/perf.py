"""Model FLOPs utilisation: what a learner step computes, over what its device can compute.

The convention (docs/speed.md): a trained token costs 3 x the forward's matrix-product FLOPs
(forward, and a backward of twice the forward), counting the attention projections, the MLP, the
causal attention scores (QK^T and AV over the tokens before each) and the lm_head, not the
embedding lookup; a scored token (no gradient) costs 1 x. A frozen base (LoRA, QLoRA) is counted
as its step computes it: no weight gradient for its matrices (`train_flops`). MFU is those FLOPs per second over the
device's dense peak for the training precision: the vendor's figure for an accelerator (a table
by device name; `RLKIT_PEAK_TFLOPS` overrides it), and on a CPU the rate this process reaches on
a large matrix product in that precision, measured once (a CPU's vendor peak assumes every core
and vector unit, which one learner process on its share of cores never has).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

# Dense peak TFLOP/s by device name (a substring of the name torch reports): (bf16/fp16, fp32).
# The fp32 column is the plain fp32 rate (PyTorch does not use TF32 for matrix products by default).
PEAK_TFLOPS = {
    "H200": (989.0, 67.0), "H100": (989.0, 67.0), "H800": (989.0, 67.0), "H20": (148.0, 44.0),
    "A100": (312.0, 19.5), "A800": (312.0, 19.5), "L40S": (362.0, 91.6), "A10": (125.0, 31.2),
    "4090": (165.2, 82.6), "3090": (71.0, 35.6), "V100": (125.0, 15.7), "T4": (65.0, 8.1),
    "MI300X": (1307.0, 163.4), "MI250": (383.0, 47.9), "K100": (196.0, 49.0),
    "910B": (313.0, 75.0), "910C": (313.0, 75.0),
}


def weight_flops(arch: Any) -> float:
    """Forward FLOPs per token of the model's weight matrices: 2 x the block linears and the lm_head
    (MoE: the experts a token uses are not known from the config, every expert is counted once as
    one MLP)."""
    return 2 * (arch.layers * sum(i * o for i, o in arch.linears().values()) + arch.hidden * arch.vocab)


def forward_flops(arch: Any, lengths: Sequence[int]) -> float:
    """Forward matrix-product FLOPs of sequences of `lengths` tokens through the model `arch`
    (`rlkit.estimate.Arch`): `weight_flops` per token, and 2 x 2 x heads x head_dim per (query,
    earlier key) pair of each layer for the scores."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)  # causal (query, key) pairs, the diagonal included
    return weight_flops(arch) * sum(lengths) + 4 * arch.layers * arch.heads * arch.head_dim * pairs


def train_flops(arch: Any, lengths: Sequence[int], adapters: int | None = None) -> float:
    """FLOPs of a forward and backward over sequences of `lengths` tokens. Full fine-tuning: 3 x the
    forward (a backward computes each product's input and weight gradients). A frozen base (LoRA,
    QLoRA; `adapters`: the trained adapter matrices' parameter count): its weight matrices compute
    the forward and the input gradient only (2 x; the first layer's input gradient is counted too),
    the attention scores, which have no weights, 3 x, and the adapters 3 x their forward (2 FLOPs a
    parameter a token)."""
    if adapters is None:
        return 3 * forward_flops(arch, lengths)
    tokens = sum(lengths)
    weights = weight_flops(arch) * tokens
    return 2 * weights + 3 * (forward_flops(arch, lengths) - weights) + 3 * 2 * adapters * tokens


def peak_flops(device: Any, dtype: str, seconds: float = 0.3) -> float:
    """FLOP/s the MFU is measured against, for a `rlkit.accel.DeviceInfo` training in `dtype`
    ("bf16", "fp16" or "fp32"): `RLKIT_PEAK_TFLOPS` if set, the table's entry for an accelerator
    named there, else (a CPU, or an accelerator not in the table: NaN for the latter) the
    matrix-product rate measured on a CPU over about `seconds` (on a shared host the fastest of
    0.3 s of products varies by 15% between processes; a bench measures longer)."""
    if os.environ.get("RLKIT_PEAK_TFLOPS"):
        return float(os.environ["RLKIT_PEAK_TFLOPS"]) * 1e12
    if device.is_accelerator:
        for name, (half, full) in PEAK_TFLOPS.items():
            if name.lower() in device.device_name.lower():
                return (full if dtype == "fp32" else half) * 1e12
        return float("nan")
    return measured_gemm_flops(dtype, seconds)


@functools.cache
def measured_gemm_flops(dtype: str, seconds: float = 0.3) -> float:
    """FLOP/s of a square matrix product in `dtype` on this process's CPU threads: the fastest of
    repeats over about `seconds` (a shared host's other work only slows a repeat down), after an
    untimed product; 1024 wide where a 512-wide product runs over 18 GFLOP/s, else 512 wide (a
    CPU without native bf16 takes ~0.2 s for it)."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    rng = torch.Generator().manual_seed(0)  # not the process's generator: training draws from that one
    small = torch.randn(512, 512, dtype=torch_dtype, generator=rng)
    small @ small  # the first product also loads the kernels
    t = time.perf_counter()
    small @ small
    n = 1024 if time.perf_counter() - t < 2 * 512**3 / 18e9 else 512
    a, b = (torch.randn(n, n, dtype=torch_dtype, generator=rng) for _ in range(2))
    a @ b
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 500):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def sequence_lengths(batch: Any) -> list[int]:
    """The real sequences' lengths in a micro-batch: its rows' attention-mask sums, or for a
    padding-free row (`position_ids` restarting per sequence, no mask) its sequences'."""
    if batch.get("attention_mask") is not None:
        return [int(n) for n in batch["attention_mask"].sum(1).tolist()]
    positions = batch["position_ids"][0]
    starts = sorted({0, *(positions == 0).nonzero().flatten().tolist()}) + [positions.shape[0]]
    return [b - a for a, b in zip(starts, starts[1:])]


class Throughput:
    """What one learner's optimizer steps computed: tokens, model FLOPs and the device's peak, for
    `StepMetrics` (`perf_metrics` turns them into tokens/s and MFU)."""

    def __init__(self, model_config: dict[str, Any], device: Any, dtype: str, adapters: int | None = None):
        from rlkit.estimate.arch import Arch

        self.adapters = adapters  # a frozen base's trained adapter parameters (`train_flops`)

        try:
            self.arch: Any = Arch.from_config(model_config, "the learner's model")
        except Exception:  # noqa: BLE001 - a config the estimate cannot read: tokens/s without MFU
            self.arch = None
        self.peak = peak_flops(device, dtype)

    def step(self, micro_batches: Sequence[Any], started: float) -> dict[str, float]:
        """The `StepMetrics` fields of a step over `micro_batches` that began at `started`
        (`time.perf_counter()`), once the device has finished its work."""
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
        seconds = time.perf_counter() - started
        lengths = [n for mb in micro_batches for n in sequence_lengths(mb)]
        flops = train_flops(self.arch, lengths, self.adapters) if self.arch is not None else float("nan")
        return {"seconds": seconds, "tokens": float(sum(lengths)), "flops": flops, "peak_flops": self.peak}


def perf_metrics(ranks: Sequence[Sequence[Any]]) -> dict[str, float]:
    """`perf/tokens_per_s` (input tokens a learner trains on per second of its optimizer steps),
    `perf/tflops` (model TFLOP/s a learner reaches) and `perf/mfu` (that over its device's peak):
    each rank's totals over its steps (`StepMetrics`), the mean over ranks."""
    rows = [(sum(s.tokens for s in steps), sum(s.flops for s in steps), sum(s.seconds for s in steps),
             steps[0].peak_flops) for steps in ranks if steps and sum(s.seconds for s in steps) > 0]
    if not rows:
        return {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {"perf/tokens_per_s": mean([t / s for t, _, s, _ in rows]),
           "perf/tflops": mean([f / s / 1e12 for _, f, s, _ in rows]),
           "perf/mfu": mean([f / s / p for _, f, s, p in rows])}
    return {k: v for k, v in out.items() if v == v}  # no FLOPs or no peak: that figure is not said
