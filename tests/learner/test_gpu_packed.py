"""The learner's token-logprob paths on a CUDA device (skipped without one): the chunked lm_head
never holds the [T, vocab] logits (peak allocation against the full-logits path), padding-free rows
score and train as the padded batch (fp32 and bf16, through `rlkit_packed_sdpa` and through a
DeepSpeed learner), and a packed forward does not wait on the device once per layer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.sides import CUDA, DS_PROBLEM, vocab_size

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

QWEN_VOCAB = 151936  # Qwen2.5's lm_head


def _qwen(vocab: int, layers: int, dtype: torch.dtype, hidden: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit.model.attention import use_packed_attention

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).to("cuda", dtype)
    assert use_packed_attention(model)
    return model


def _rollout_batch(vocab: int, rows: int, seed: int):
    from rlkit.grpo.batch import GRPOBatch, Rollout

    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: torch.randint(4, vocab, (int(torch.randint(lo, hi, (1,), generator=gen)),),  # noqa: E731
                                        generator=gen).tolist()
    rollouts = [Rollout(rand(5, 40), rand(1, 60), False) for _ in range(rows)]
    return GRPOBatch.collate(rollouts, torch.randn(rows, generator=gen), pad_id=0)


def _cuda(mb: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


# ------------------------------------------------------------------ no full-vocabulary logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_training_step_on_qwens_vocabulary_does_not_hold_the_logits(dtype):
    """Forward + backward of the token logprobs of one 4096-token sequence at Qwen's 152k vocabulary
    (fp32 logits: 2.3 GiB): torch's peak allocation on the chunked path is lower than the
    full-logits path's by more than the logits' fp32 size and below one copy of them; logprobs and
    gradients agree (fp32: 1e-5, bf16: within its rounding)."""
    from rlkit.learner import logprobs as lp

    model = _qwen(QWEN_VOCAB, layers=1, dtype=dtype)
    ids = torch.randint(0, QWEN_VOCAB, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits_bytes = ids.numel() * QWEN_VOCAB * 4

    def step(mode: str):
        if mode == "full":
            logp = lp.selective_log_softmax(model(**batch).logits[:, :-1].float(), ids[:, 1:])
        else:
            logp, _ = lp.token_logprobs(model, batch, with_entropy=True)
        logp.sum().backward()
        grad = model.get_input_embeddings().weight.grad.float().clone()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: not part of the difference
        return logp.detach(), grad

    peaks, out = {}, {}
    for mode in ("chunked", "full", "chunked"):
        step(mode)  # the first touch of the gradients and of the allocator's blocks
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out[mode] = step(mode)
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - before
    diff = (out["chunked"][0] - out["full"][0]).abs()
    grad_rel = float((out["chunked"][1] - out["full"][1]).norm() / out["full"][1].norm())
    print(f"\n{dtype}: peak allocated over one step, full logits {peaks['full'] / 2**20:.0f} MiB, chunked "
          f"{peaks['chunked'] / 2**20:.0f} MiB (fp32 logits {logits_bytes / 2**20:.0f} MiB); logprobs max abs diff "
          f"{diff.max():.2e}, embedding gradient relative diff {grad_rel:.2e}")
    assert peaks["full"] - peaks["chunked"] >= logits_bytes, peaks
    assert peaks["chunked"] < logits_bytes, peaks
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert diff.max() < tol and grad_rel < (1e-5 if dtype == torch.float32 else 2e-2), (float(diff.max()), grad_rel)


# ------------------------------------------------------------------ padding-free rows


def test_packed_rows_score_and_train_as_the_padded_batch_in_fp32_and_bf16():
    """Eight completions of random lengths, padded vs packed into one row (`rlkit_packed_sdpa` runs
    CUDA's sdpa on each sequence; the padded batch runs it with a mask): fp32 logprobs, entropy and
    GRPO loss within 1e-5, gradients within 1e-4 of their norm; in bf16 both layouts sit within
    bf16's rounding of the fp32 padded result (mean 0.02, max 0.1 nats, the bound of the learner's
    bf16 test)."""
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.rollout.config import RolloutConfig

    model = _qwen(4096, layers=4, dtype=torch.bfloat16, hidden=256).float()  # fp32 on bf16 values: the same weights
    b = _rollout_batch(4096, rows=8, seed=0)
    padded, packed = _cuda(b.micro_batch(range(8))), _cuda(b.packed_micro_batch(range(8)))
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.9))
    norm = torch.tensor(float(b.completion_tokens()), dtype=torch.float64, device="cuda")
    where = padded["completion_mask"][:, 1:].bool()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for name, mb in (("padded", padded), ("packed", packed)):
            logp, entropy = token_logprobs(model, mb, 0.9, with_entropy=True, positions=objective.positions(mb))
            loss, _ = objective(model, {**mb, "num_items_in_batch": norm})
            loss.backward()
            grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            results[dtype, name] = (logp.detach()[where], entropy[where], float(loss.detach()), grad)

    (lp32, ent32, loss32, g32), (lpk, entk, lossk, gk) = (results[torch.float32, name] for name in ("padded", "packed"))
    grad_rel = float((gk - g32).norm() / g32.norm())
    print(f"\nfp32 packed vs padded: logprobs max abs diff {(lpk - lp32).abs().max():.2e}, entropy "
          f"{(entk - ent32).abs().max():.2e}, loss {abs(lossk - loss32):.2e}, gradient relative {grad_rel:.2e}")
    torch.testing.assert_close(lpk, lp32, atol=1e-5, rtol=0)
    torch.testing.assert_close(entk, ent32, atol=1e-5, rtol=0)
    assert abs(lossk - loss32) < 1e-5 and grad_rel < 1e-4, (lossk, loss32, grad_rel)
    for name in ("padded", "packed"):
        diff = (results[torch.bfloat16, name][0] - lp32).abs()
        print(f"bf16 {name} vs fp32 padded: logprobs max abs diff {diff.max():.4f}, mean {diff.mean():.4f}")
        assert diff.mean() < 0.02 and diff.max() < 0.1, (name, float(diff.mean()), float(diff.max()))
        assert math.isfinite(results[torch.bfloat16, name][2])


def test_a_packed_forward_does_not_wait_on_the_device_per_layer():
    """The sequence bounds of a packed row are read on the host once per forward, not by each
    layer's attention (a `.tolist()` of a device tensor per layer is a device sync per layer):
    the synchronising calls torch reports in a packed forward are as many at 16 layers as at 4."""
    from rlkit.learner.logprobs import token_logprobs

    packed = _cuda(_rollout_batch(4096, rows=8, seed=1).packed_micro_batch(range(8)))
    counts = {}
    for layers in (4, 16):
        model = _qwen(4096, layers=layers, dtype=torch.bfloat16)
        with torch.no_grad():
            token_logprobs(model, packed)  # the first call checks the model's logits once (a sync of its own)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    token_logprobs(model, packed)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        counts[layers] = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    print(f"\nsynchronising calls in a packed forward: {counts[4]} at 4 layers, {counts[16]} at 16")
    assert counts[16] == counts[4], counts


# ------------------------------------------------------------------ through a DeepSpeed learner


@pytest.mark.skipif(DS_PROBLEM is not None, reason=DS_PROBLEM or "")
@pytest.mark.parametrize("zero", [0, 3])
def test_a_bf16_learner_scores_and_trains_packed_micro_batches(learners, tmp_path, zero):
    """A bf16 DeepSpeed learner (ZeRO `zero`) on packed micro-batches (`grpo.max_tokens_per_micro_batch`):
    logprobs match the padded micro-batch within bf16's rounding, the GRPO step is finite and on
    policy (ratio 1), and it moves the policy."""
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.rollout.config import RolloutConfig
    from rlkit.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "25m", "25m")
    learner, _ = learners(model_dir, zero)
    b = _rollout_batch(vocab_size(model_dir), rows=8, seed=2)
    norm = torch.tensor(float(b.completion_tokens()), dtype=torch.float64)
    padded = {**b.micro_batch(range(8)), "num_items_in_batch": norm}
    packed = {**b.packed_micro_batch(range(8)), "num_items_in_batch": norm}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=1.0, max_tokens=64))
    where = padded["completion_mask"][:, 1:].bool()
    got_padded, got_packed = learner.logprobs([padded, packed], positions=objective.positions)
    diff = (got_packed - got_padded)[where].abs()
    print(f"\nZeRO-{zero} bf16 learner, packed vs padded logprobs: max abs diff {diff.max():.4f}, "
          f"mean {diff.mean():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.1, (float(diff.mean()), float(diff.max()))

    fit = learner.fit([[dict(packed)]], objective)
    (step,) = fit.steps
    after = learner.logprobs([packed], positions=objective.positions)[0]
    metrics = {k: step.mean(k) for k in step.sums}
    print(f"ZeRO-{zero} packed GRPO step: grad_norm {step.grad_norm:.4f}, ratio_mean {metrics['ratio_mean']:.4f}")
    assert all(math.isfinite(v) for v in metrics.values()) and math.isfinite(step.grad_norm) and step.grad_norm > 0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-2)
    assert (after - got_packed)[where].abs().max() > 1e-3
