"""MFU's arithmetic (`rlkit/learner/perf.py`): FLOPs by hand, sequence lengths of padded and packed
micro-batches, the device's peak, and the per-learner figures a step's metrics carry."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlkit.estimate import PUBLISHED, Arch
from rlkit.learner.objective import StepMetrics
from rlkit.learner.perf import forward_flops, peak_flops, perf_metrics, sequence_lengths, train_flops


def test_flops_of_qwen2_5_1_5b_by_hand():
    """The convention's numbers for R1-Distill-Qwen-1.5B (untied), 8 x 1024 tokens, written out:
    per token 2 x (28 layers x (q, k, v, o, gate, up, down) + lm_head), and per layer and causal
    (query, key) pair 2 x 2 x 12 heads x 128."""
    arch = Arch.from_config(PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"], "r1-1.5b")
    h, kv, i, v = 1536, 2 * 128, 8960, 151936
    block = h * h + 2 * h * kv + h * h + 3 * h * i
    per_token = 2 * (28 * block + h * v)
    pairs = 8 * 1024 * 1025 // 2
    want = per_token * 8192 + 4 * 28 * 12 * 128 * pairs
    assert forward_flops(arch, [1024] * 8) == want
    assert train_flops(arch, [1024] * 8) == 3 * want
    # the issue's table: 0.238 s a step is 33% of an H200's 989 TFLOP/s, 0.193 s 41%
    assert train_flops(arch, [1024] * 8) / 0.238 / 989e12 == pytest.approx(0.33, abs=0.005)
    assert train_flops(arch, [1024] * 8) / 0.193 / 989e12 == pytest.approx(0.41, abs=0.005)
    # two sequences of 512 cost the same per-token work, fewer attention pairs
    assert forward_flops(arch, [512, 512]) < forward_flops(arch, [1024])


def test_a_frozen_base_is_credited_with_the_work_its_step_does():
    """LoRA r=16 on the seven linears of the same shape: the base's weight matrices (and lm_head) a
    forward and an input gradient (2 x), the scores 3 x, the adapters 3 x their forward; about 2/3
    of a full step's FLOPs, not the full step's (the MFU of a LoRA step was credited with weight
    gradients it never computes)."""
    arch = Arch.from_config(PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"], "r1-1.5b")
    h, kv, i, v, r = 1536, 2 * 128, 8960, 151936, 16
    weights = 2 * (28 * (h * h + 2 * h * kv + h * h + 3 * h * i) + h * v) * 8192
    scores = 4 * 28 * 12 * 128 * (8 * 1024 * 1025 // 2)
    adapters = 28 * r * sum(a + b for a, b in [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)])
    lora = train_flops(arch, [1024] * 8, adapters)
    assert lora == 2 * weights + 3 * scores + 6 * adapters * 8192
    assert train_flops(arch, [1024] * 8, None) == 3 * (weights + scores)
    assert 0.66 < lora / train_flops(arch, [1024] * 8) < 0.72


def test_sequence_lengths_of_padded_and_packed_micro_batches():
    padded = {"input_ids": torch.zeros(3, 6, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])}
    assert sequence_lengths(padded) == [6, 4, 2]
    packed = {"input_ids": torch.zeros(1, 9, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])}
    assert sequence_lengths(packed) == [4, 2, 3]


def test_peak_is_the_table_for_accelerators_the_override_or_a_measured_rate():
    h200 = SimpleNamespace(is_accelerator=True, device_name="NVIDIA H200")
    assert peak_flops(h200, "bf16") == 989e12 and peak_flops(h200, "fp32") == 67e12
    assert math.isnan(peak_flops(SimpleNamespace(is_accelerator=True, device_name="Unknown X1"), "bf16"))
    cpu = SimpleNamespace(is_accelerator=False, device_name="cpu")
    rate = peak_flops(cpu, "fp32")
    assert 1e9 < rate < 1e13  # a real measurement: between 1 GFLOP/s and 10 TFLOP/s on one process
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLKIT_PEAK_TFLOPS", "100")
        assert peak_flops(h200, "bf16") == 100e12 and peak_flops(cpu, "fp32") == 100e12


def test_perf_metrics_are_each_learners_totals_averaged_over_learners():
    def step(tokens, seconds, flops):
        return StepMetrics({}, 1, 1.0, 1e-5, seconds=seconds, tokens=tokens, flops=flops, peak_flops=1e12)

    ranks = [[step(100, 1.0, 2e11), step(300, 1.0, 6e11)],  # 200 tokens/s, 0.4 TFLOP/s
             [step(100, 2.0, 4e11)]]  # 50 tokens/s, 0.2 TFLOP/s
    out = perf_metrics(ranks)
    assert out["perf/tokens_per_s"] == pytest.approx(125.0)
    assert out["perf/tflops"] == pytest.approx(0.3)
    assert out["perf/mfu"] == pytest.approx(0.3)
    assert perf_metrics([[StepMetrics({}, 1, 1.0, 1e-5)]]) == {}  # no timing: nothing said
