"""The distillation losses: TRL 1.16's generalized JSD on identical hidden states and heads (values
and the student's gradients), no [tokens, vocab] tensor kept for the backward, and the reverse-KL
advantage pulling a student toward its teacher."""

from __future__ import annotations

import pytest
import torch

from rlkit.distill.loss import generalized_jsd, reverse_kl_advantages


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, H_s, H_t, V = 3, 7, 16, 24, 50
    h_s = torch.randn(B, T, H_s, generator=g, requires_grad=True)
    h_t = torch.randn(B, T, H_t, generator=g)
    w_s = (torch.randn(V, H_s, generator=g) * 0.3).requires_grad_()
    w_t = torch.randn(V, H_t, generator=g) * 0.3
    b_s = (torch.randn(V, generator=g) * 0.1).requires_grad_()
    b_t = torch.randn(V, generator=g) * 0.1
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    return h_s, h_t, w_s, w_t, b_s, b_t, mask


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature,items", [(1.0, None), (0.7, 11)])
def test_generalized_jsd_equals_trls_distillation_loss(beta, temperature, items):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    h_s, h_t, w_s, w_t, b_s, b_t, mask = _case()
    ours = generalized_jsd(h_s, h_t, w_s, w_t, mask, beta=beta, temperature=temperature, student_bias=b_s,
                           teacher_bias=b_t, num_items_in_batch=items, chunk_tokens=4)
    grads = torch.autograd.grad(ours[0], [h_s, w_s, b_s])
    theirs = _chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta, num_items_in_batch=items,
                                      student_lm_head_bias=b_s, teacher_lm_head_bias=b_t, temperature=temperature)
    want = torch.autograd.grad(theirs[0], [h_s, w_s, b_s])
    assert ours[0].item() > 0
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1].float(), rtol=1e-5, atol=1e-5)  # the student's entropy
    assert int(ours[2]) == int(theirs[2]) == int(mask.sum())
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-6)


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward():
    """Each chunk is recomputed in the backward: autograd keeps no logits [positions, vocab]."""
    from rlkit.distill import loss as distill_loss

    h_s, h_t, w_s, w_t, b_s, b_t, mask = _case(1)
    vocab = w_s.shape[0]
    heads = {w_s.data_ptr(), w_t.data_ptr()}
    rows: list[int] = []  # the rows of each saved tensor with a vocabulary-wide last dimension (not a head)

    def pack(t):
        if t.dim() == 2 and t.shape[-1] == vocab and t.data_ptr() not in heads:
            rows.append(t.shape[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, n = generalized_jsd(h_s, h_t, w_s, w_t, mask, beta=0.5, chunk_tokens=4)
    loss.backward()
    assert h_s.grad is not None and w_s.grad is not None and int(n) > 4
    assert rows == [], rows
    # the same math without the checkpoint keeps them: the check can fail
    valid = mask.reshape(-1) != 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        distill_loss._chunk(h_s.reshape(-1, h_s.shape[-1])[valid], w_s, None, h_t.reshape(-1, h_t.shape[-1])[valid],
                            w_t, None, vocab, 0.5, 1.0)
    assert rows and max(rows) == int(n)


def test_bad_arguments_say_what_to_change():
    h_s, h_t, w_s, w_t, _, _, mask = _case()
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        generalized_jsd(h_s, h_t, w_s, w_t, mask, beta=1.5)
    with pytest.raises(ValueError, match="distillation needs one tokenizer"):
        generalized_jsd(h_s, h_t, w_s, w_t[:-1], mask)


def test_the_reverse_kl_advantage_pulls_the_student_to_the_teacher():
    """Policy gradient on sampled tokens with `log p_t - log p_s` as the advantage lowers the exact
    KL(p_s || p_t) of a categorical student (what on-policy distillation does per position)."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(8) * 2, -1)
    student = torch.zeros(8, requires_grad=True)
    opt = torch.optim.Adam([student], lr=0.05)

    def kl() -> float:
        log_ps = torch.log_softmax(student.detach(), -1)
        return float((log_ps.exp() * (log_ps - teacher)).sum())

    before = kl()
    for _ in range(200):
        log_ps = torch.log_softmax(student, -1)
        tokens = torch.multinomial(log_ps.exp().detach(), 256, replacement=True)
        logp = log_ps[tokens][None]
        adv = reverse_kl_advantages(logp.detach(), teacher[tokens][None], torch.ones_like(logp))
        loss = -(adv * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert kl() < 0.1 * before, (before, kl())
    same = torch.randn(2, 5)
    assert torch.equal(reverse_kl_advantages(same, same, torch.ones(2, 5)), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="must have one shape"):
        reverse_kl_advantages(same, same[:, :4], torch.ones(2, 5))


def test_a_teacher_with_another_tokenizer_is_one_line(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from rlkit.distill.teacher import check_same_tokenizer
    from rlkit.errors import ConfigError

    check_same_tokenizer(tiny_model, tiny_model)  # a teacher of the student's family
    other = AutoTokenizer.from_pretrained(tiny_model)
    n = len(other)
    other.add_tokens(["<tool_call_x>"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=rf"^distill.teacher: the teacher .*other and the student .* have other "
                                          rf"tokenizers \({n + 1} and {n} tokens; token '<tool_call_x>' is id {n} in "
                                          r"the teacher's only\): on-policy distillation needs one tokenizer"):
        check_same_tokenizer(tiny_model, tmp_path / "other")
