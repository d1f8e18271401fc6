"""The fused lm_head logprobs (`rlkit/learner/head.py`) against autograd through the full logits:
the values, the entropy and every gradient, chunked or not, kept or projected again, in fp64
(exact) and bf16 (the training precision: the same rounding as the unfused path)."""

from __future__ import annotations

import pytest
import torch

from rlkit.learner.head import KEEP_BYTES, fusable, head_logprobs, keep_budget


def _head(dtype: torch.dtype, bias: bool, vocab: int = 300, hidden: int = 32, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.mul_(4.0)  # peaked distributions: probabilities near 1 and near 0 both occur
    return head.to(dtype)


def _reference(states: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float):
    """Autograd through the [N, vocab] logits, upcast as the unfused path does."""
    logits = head(states)
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy.detach()


@pytest.mark.parametrize("chunk,keep", [(None, True), (7, True), (7, False), (1, False)],
                         ids=["one-chunk-kept", "chunks-kept", "chunks-projected-again", "rows-projected-again"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp64_logprobs_entropy_and_gradients_are_the_full_logits(chunk, keep, bias):
    head = _head(torch.float64, bias)
    states = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    upstream = torch.randn(40, dtype=torch.float64)
    logp, entropy = head_logprobs(states, head, targets, 0.7, True, chunk, keep_bytes=2**30 if keep else 0)
    (logp * upstream).sum().backward()
    got = {"states": states.grad, **{n: p.grad for n, p in head.named_parameters()}}
    states.grad, head.zero_grad()
    want, want_entropy = _reference(states, head, targets, 0.7)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-12, rtol=0)
    assert not entropy.requires_grad
    for name, p in {"states": states, **dict(head.named_parameters())}.items():
        torch.testing.assert_close(got[name], p.grad, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "projected-again"])
def test_bf16_head_matches_the_unfused_path_within_its_rounding(keep):
    """A bf16 head: the logprobs of the same bf16 logits (bit for bit the same products), and
    gradients within bf16's rounding of the unfused path's (which casts its fp32 logits' gradient
    to bf16 as this does)."""
    head = _head(torch.bfloat16, False)
    states = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    upstream = torch.randn(40)
    logp, entropy = head_logprobs(states, head, targets, 1.0, True, 16, keep_bytes=2**30 if keep else 0)
    assert logp.dtype == entropy.dtype == torch.float32
    (logp * upstream).sum().backward()
    got = (states.grad.clone(), head.weight.grad.clone())
    states.grad, head.weight.grad = None, None
    want, want_entropy = _reference(states, head, targets, 1.0)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    for mine, theirs in zip(got, (states.grad, head.weight.grad)):
        scale = theirs.float().abs().max()
        assert (mine.float() - theirs.float()).abs().max() <= 0.02 * scale, ((mine.float() - theirs.float())
                                                                             .abs().max(), scale)


def test_without_gradients_nothing_is_kept_and_the_values_are_the_same(monkeypatch):
    import rlkit.learner.head as fused

    head = _head(torch.float32, False)  # its weight requires a gradient: only grad mode says none comes
    states, targets = torch.randn(20, 32), torch.randint(0, 300, (20,))
    kept, apply = [], fused._HeadLogprobs.apply
    monkeypatch.setattr(fused._HeadLogprobs, "apply", lambda *a: kept.append(a[-1]) or apply(*a))
    with torch.no_grad():
        logp, entropy = head_logprobs(states, head, targets, 1.3, True)
        bare, none = head_logprobs(states, head, targets, 1.3)
    head_logprobs(states, head, targets, 1.3)
    assert kept == [False, False, True]  # kept (20 x 300 fp32 fits the budget) only where a backward may come
    want, want_entropy = _reference(states, head, targets, 1.3)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(bare, logp, atol=0, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    assert none is None and logp.grad_fn is None


def test_a_half_precision_weight_gradient_sums_its_chunks_in_fp32():
    """Summed in bf16, 64 chunks of a bf16 head's weight gradient are three times as far from the
    fp64 gradient as one chunk's product (measured: 1.9x at 16 chunks, 3.2x at 64); summed in
    fp32, within a quarter of it, and returned in the weight's dtype."""
    torch.manual_seed(0)
    exact = torch.nn.Linear(64, 512, bias=True, dtype=torch.float64)
    states, targets, upstream = torch.randn(1024, 64, dtype=torch.float64), torch.randint(0, 512, (1024,)), \
        torch.randn(1024)

    def grads(head: torch.nn.Linear, chunk: int) -> list[torch.Tensor]:
        head.zero_grad()
        logp, _ = head_logprobs(states.to(head.weight.dtype), head, targets, 0.7, False, chunk, keep_bytes=0)
        (logp * upstream.to(logp.dtype)).sum().backward()
        return [head.weight.grad, head.bias.grad]

    want = [g.clone() for g in grads(exact, 1024)]
    half = torch.nn.Linear(64, 512, dtype=torch.bfloat16)
    half.load_state_dict(exact.state_dict())
    for name, one, many, ref in zip(("weight", "bias"), grads(half, 1024), grads(half, 16), want):
        assert many.dtype == torch.bfloat16
        one_error = (one.double() - ref).norm() / ref.norm()
        many_error = (many.double() - ref).norm() / ref.norm()
        assert many_error <= 1.25 * one_error, (name, float(one_error), float(many_error))


def test_the_keep_budget_is_a_share_of_an_accelerators_free_memory(monkeypatch):
    """A CPU keeps up to the fixed KEEP_BYTES; an accelerator a quarter of the memory free when the
    head runs (read there: torch's mem_get_info and its allocator's unused blocks, checked on a GPU
    by tests/learner/test_gpu_kernels.py), so 8 x 1024 tokens of Qwen's 152k vocabulary in bf16
    (2.3 GiB) are kept on a device with 10 GiB free, not projected again."""
    import rlkit.learner.head as fused

    assert keep_budget(torch.device("cpu")) == KEEP_BYTES
    monkeypatch.setattr(fused, "_free_bytes", lambda device: 10 * 2**30)
    assert keep_budget(torch.device("cpu")) == 10 * 2**30 // 4
    head = _head(torch.bfloat16, False, vocab=1000)
    states = torch.randn(50, 32, dtype=torch.bfloat16, requires_grad=True)
    kept, apply = [], fused._HeadLogprobs.apply
    monkeypatch.setattr(fused._HeadLogprobs, "apply", lambda *a: kept.append(a[-1]) or apply(*a))
    for free in (4 * 50 * 1000 * 2, 4 * 50 * 1000 * 2 - 4):  # room for the bf16 logits, then 1 byte short
        monkeypatch.setattr(fused, "_free_bytes", lambda device, free=free: free)
        head_logprobs(states, head, torch.randint(0, 1000, (50,)), 1.0, False, 8)
    assert kept == [True, False]


def test_only_a_plain_unpartitioned_linear_head_is_fused():
    from peft import LoraConfig, get_peft_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 16)

    plain = torch.nn.Linear(8, 16)
    assert fusable(plain)
    partitioned = torch.nn.Linear(8, 16)
    partitioned.weight.ds_id = 3  # what ZeRO-3 marks its partitioned parameters with
    assert not fusable(partitioned)
    adapted = get_peft_model(Net(), LoraConfig(r=2, target_modules=["lm_head"]))
    assert not fusable(adapted.base_model.model.lm_head)
