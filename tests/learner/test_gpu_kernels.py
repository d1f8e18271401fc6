"""The learner's fast paths on a CUDA device (skipped without CUDA or DeepSpeed): the fused lm_head
logprobs in bf16 against an fp32 forward of the same weights, the optimizer DeepSpeed steps for
bf16, and Liger's kernels (`model.kernels: liger`) against transformers' own modules (in the one
model instance: the fp32 references built after it run transformers' code)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.sides import CUDA_LEARNER_MARKS, hf_logprobs, load_hf, vocab_size

pytestmark = CUDA_LEARNER_MARKS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from rlkit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpu-kernels") / "25m", "25m")


def _batch(model_dir: Path, rows: int = 4, length: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, vocab_size(model_dir), (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bf16_steps_use_fp32_master_weights_in_a_flat_fused_optimizer(learners, model_dir, zero):
    """bf16 at ZeRO 0 and 1 runs DeepSpeed's BF16_Optimizer (fp32 master weights and gradient
    accumulation, one flat partition stepped by torch's fused AdamW), never the per-tensor
    FP16_UnfusedOptimizer; ZeRO-2 its ZeRO optimizer. The NLL of a fixed batch falls."""
    from rlkit.sft.objective import NLLObjective

    learner, summary = learners(model_dir, zero)
    name = type(learner.engine.optimizer).__name__
    print(f"\nZeRO-{zero} bf16 optimizer: {name}")
    assert name != "FP16_UnfusedOptimizer"
    assert name == ("BF16_Optimizer" if zero < 2 else "DeepSpeedZeroOptimizer")
    batch = _batch(model_dir)
    losses = [learner.train_step([batch], NLLObjective()).sums["nll"] for _ in range(8)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.7 * losses[0], losses


def test_liger_kernels_score_as_transformers_modules_and_train(learners, model_dir):
    """`model.kernels: none` then `liger` on the same weights: Liger's RMSNorm, SwiGLU and RoPE are
    in the model, its logprobs within bf16 noise of transformers' modules' (and both of an fp32
    forward), and a step trains."""
    pytest.importorskip("liger_kernel")
    from rlkit.sft.objective import NLLObjective

    probe = _batch(model_dir, seed=3)
    plain, _ = learners(model_dir, 0, model={"kernels": "none"})
    assert plain.engine.module.model.norm._get_name() == "Qwen2RMSNorm"
    want = plain.logprobs([probe])[0]
    fused, _ = learners(model_dir, 0, model={"kernels": "liger"})
    module = fused.engine.module
    assert (module.model.norm._get_name(), module.model.layers[0].mlp._get_name()) == ("LigerRMSNorm", "LigerSwiGLUMLP")
    got = fused.logprobs([probe])[0]
    fp32 = torch.stack([hf_logprobs(load_hf(model_dir), row.tolist()) for row in probe["input_ids"]])
    diff = (got - want).abs()
    print(f"\nliger vs transformers' modules, bf16: max {diff.max():.4f}, mean {diff.mean():.4f}; "
          f"liger vs fp32: mean {(got - fp32).abs().mean():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.1
    assert (got - fp32).abs().mean() < 0.02
    losses = [fused.train_step([probe], NLLObjective()).sums["nll"] for _ in range(6)]
    assert losses[-1] < losses[0], losses


def test_fused_head_in_bf16_matches_autograd_through_the_full_logits():
    """`head_logprobs` on CUDA at a 152k vocabulary (Qwen's), bf16: logprobs of the same bf16
    logits as the unfused path, entropy and gradients within bf16 rounding; kept and projected
    again alike; its peak allocation under the full fp32 logits' size."""
    from rlkit.learner.head import head_logprobs, keep_budget

    torch.manual_seed(0)
    head = torch.nn.Linear(512, 151936, bias=False, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 151936, (4096,), device="cuda")
    upstream = torch.randn(4096, device="cuda")
    logits = head(states).float()
    want = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (want * upstream).sum().backward()
    grads = states.grad.clone(), head.weight.grad.clone()
    for keep in (2**31, 0):
        states.grad = head.weight.grad = None
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        got, entropy = head_logprobs(states, head, targets, 1.0, True, chunk_tokens=256, keep_bytes=keep)
        (got * upstream).sum().backward()
        peak = torch.cuda.max_memory_allocated() - start
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert torch.isfinite(entropy).all()
        for mine, theirs in zip((states.grad, head.weight.grad), grads):
            assert (mine.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()
        print(f"\nkeep {keep}: peak {peak / 2**20:.0f} MiB (fp32 logits: {4096 * 151936 * 4 / 2**20:.0f} MiB)")
        if not keep:  # a chunk's logits, the weight's gradient and its fp32 sum over the 16 chunks
            assert peak < 4096 * 151936 * 4
    budget, (free, _total) = keep_budget(states.device), torch.cuda.mem_get_info()
    print(f"keep budget {budget / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free")
    assert free // 4 <= budget <= (free + torch.cuda.memory_reserved()) // 4
