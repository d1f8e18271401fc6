"""On-policy distillation losses (pure tensor math, torch only).

The student samples completions; a frozen teacher scores the same tokens. Two objectives:

* :func:`reverse_kl_advantages`: the sampled per-token reverse KL as the advantage,
  ``log p_teacher(x_t) - log p_student(x_t)`` on the student's own tokens (Thinking Machines'
  on-policy distillation, prime-rl ``opd``); it needs only the two models' log-probs of the
  sampled tokens and goes through the GRPO policy loss, optionally added to task rewards.
* :func:`generalized_jsd`: the generalized Jensen-Shannon divergence over the whole vocabulary
  at every completion position, TRL 1.16 ``DistillationTrainer``'s loss
  (``trl/trainer/distillation_trainer.py``, ``_chunked_divergence_loss``): with the mixture
  ``m = (1 - beta) p_s + beta p_t``, ``JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)``;
  ``beta = 0`` is the forward KL(p_t || p_s), ``beta = 1`` the reverse KL(p_s || p_t). Both
  distributions are ``softmax(logits / temperature)``.

The full-vocabulary loss starts from the two models' last hidden states and their ``lm_head``
weights and projects ``chunk_tokens`` positions at a time, each chunk under activation
checkpointing (as the learner's token log-probs, ``rlkit/learner/logprobs.py``): the
``[tokens, vocab]`` logits of student and teacher exist for one chunk only, in the forward and
again in the backward (a 150k vocabulary at 4k tokens would be 2.4 GiB per model in fp32
otherwise). Gradients reach the student only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def reverse_kl_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token advantages [B, T]: ``teacher_logp - student_logp`` on the mask's tokens, 0 elsewhere.

    Its mean over the tokens is minus the sampled estimate of KL(p_s || p_t): maximising it with
    the policy gradient pulls the student toward the teacher where the student samples."""
    if not (student_logp.shape == teacher_logp.shape == mask.shape):
        raise ValueError(f"student_logp {tuple(student_logp.shape)}, teacher_logp {tuple(teacher_logp.shape)} and "
                         f"mask {tuple(mask.shape)} must have one shape")
    return (teacher_logp - student_logp).detach() * mask


def _divergence(s_logits: Tensor, t_logits: Tensor, beta: float, temperature: float) -> tuple[Tensor, Tensor]:
    """Per-row generalized JSD and the student's entropy for logits [N, V] (fp32)."""
    log_ps = torch.log_softmax(s_logits.float() / temperature, dim=-1)
    log_pt = torch.log_softmax(t_logits.float() / temperature, dim=-1)
    ps = log_ps.exp()
    entropy = -(ps * log_ps).sum(-1).detach()
    if beta == 0.0:  # forward KL(p_t || p_s)
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1), entropy
    if beta == 1.0:  # reverse KL(p_s || p_t)
        return (ps * (log_ps - log_pt)).sum(-1), entropy
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    jsd = beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    return jsd, entropy


def _project(h: Tensor, head: Tensor | torch.nn.Module, bias: Tensor | None, vocab: int) -> Tensor:
    logits = head(h) if isinstance(head, torch.nn.Module) else torch.nn.functional.linear(h, head, bias)
    return logits[..., :vocab]


def _rows(head: Tensor | torch.nn.Module) -> int:
    """The vocabulary rows of a head (a ZeRO-3 partitioned weight keeps its full shape in `ds_shape`)."""
    if not isinstance(head, torch.nn.Module):
        return head.shape[0]
    return getattr(head.weight, "ds_shape", head.weight.shape)[0]


def _chunk(h_s: Tensor, head_s: Tensor | torch.nn.Module, b_s: Tensor | None, h_t: Tensor,
           head_t: Tensor | torch.nn.Module, b_t: Tensor | None, vocab: int, beta: float,
           temperature: float) -> tuple[Tensor, Tensor]:
    s_logits = _project(h_s, head_s, b_s, vocab)
    with torch.no_grad():
        t_logits = _project(h_t, head_t, b_t, vocab)
    return _divergence(s_logits, t_logits, beta, temperature)


def generalized_jsd(student_hidden: Tensor, teacher_hidden: Tensor, student_head: Tensor | torch.nn.Module,
                    teacher_head: Tensor | torch.nn.Module, mask: Tensor, *, beta: float = 0.5,
                    temperature: float = 1.0, student_bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                    num_items_in_batch: int | float | Tensor | None = None, chunk_tokens: int | None = None,
                    vocab: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """TRL's distillation loss over the completion positions, chunked.

    student_hidden [B, T, H_s] and teacher_hidden [B, T, H_t]: the last hidden states aligned to
    the completion tokens (position t predicts token t); student_head and teacher_head: the
    ``lm_head`` weights [V, H] (with the optional biases), or the ``lm_head`` modules themselves
    (a module call, so that ZeRO-3 gathers a partitioned head inside the chunk). mask [B, T]: 1 on
    the positions that count. ``vocab``: compare the first ``vocab`` logits only (a family pads
    its ``lm_head`` to other sizes past the tokenizer's tokens, e.g. Qwen2.5 1.5B 151936 and 7B
    152064 rows); without it the two heads must have one vocabulary. Returns (loss, the sum of
    the student's entropy over those positions, their number); the loss is their divergences'
    sum over ``num_items_in_batch`` (gradient-accumulation-correct, as TRL) or, without it, their
    mean. ``chunk_tokens``: the positions projected at once (default: the learner's logits chunk,
    2**26 elements, over V).
    """
    from rlkit.learner.logprobs import CHUNK_ELEMENTS, head_calls_on_every_rank

    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows_s, rows_t = _rows(student_head), _rows(teacher_head)
    if vocab is None and rows_s != rows_t:
        raise ValueError(f"student and teacher vocabularies differ ({rows_s} vs {rows_t} rows of lm_head): "
                         "distillation needs one tokenizer")
    vocab = min(vocab or rows_s, rows_s, rows_t)
    valid = mask.reshape(-1) != 0
    h_s = student_hidden.reshape(-1, student_hidden.shape[-1])[valid]
    h_t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[valid].detach()
    head_t = teacher_head if isinstance(teacher_head, torch.nn.Module) else teacher_head.detach()
    b_t = teacher_bias.detach() if teacher_bias is not None else None
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab)
    grad = torch.is_grad_enabled() and (h_s.requires_grad or (
        student_head.weight.requires_grad if isinstance(student_head, torch.nn.Module) else student_head.requires_grad))
    divergences, entropies = [], []
    # At least one chunk, empty when the micro-batch has no position (the loss keeps the graph: a
    # zero gradient, as a micro-batch's loss must have), and under ZeRO-3 as many as any rank makes
    # (each call of the student's head gathers its weight with the other ranks)
    calls = head_calls_on_every_rank(max(math.ceil(h_s.shape[0] / chunk_tokens), 1), student_head, h_s.device)
    for start in range(0, calls * chunk_tokens, chunk_tokens):
        end = start + chunk_tokens
        args = (h_s[start:end], student_head, student_bias, h_t[start:end], head_t, b_t, vocab, beta, temperature)
        d, e = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        divergences.append(d)
        entropies.append(e)
    n = valid.sum()
    total = torch.cat(divergences).sum()
    entropy = torch.cat(entropies).sum()
    if num_items_in_batch is None:
        return total / n.clamp(min=1), entropy, n
    return total / num_items_in_batch, entropy, n
