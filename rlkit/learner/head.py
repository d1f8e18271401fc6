"""Token logprobs and entropy from final hidden states: the lm_head's projection, the
log-softmax at a temperature and the gather of the target, as one autograd function (torch only).

Forward, a chunk of positions at a time: z = h W^T (+ b) in the head's dtype, upcast to fp32 and
scaled by 1/T in place; one logsumexp gives both logp = z[target] - lse and the entropy
lse - sum(p z). Backward: d logp / d z = onehot(target) - p, so the logits' gradient is
g (onehot - p) / T, formed in place in the probabilities' buffer, and two matrix products give
the gradients of the hidden states and of the weight. Where what the backward reads fits
`KEEP_BYTES` (fp32 probabilities, or a half-precision head's own logits, for every position),
the forward keeps it and the lm_head is not projected again; otherwise each chunk is projected
again in backward. On an accelerator `keep_budget` sizes that from the memory free when the head
runs (after the model's forward); on a CPU it is the fixed `KEEP_BYTES`. Under no_grad nothing is
kept. A half-precision weight's gradient sums its chunks in fp32.

At most one chunk of fp32 logits (and its probabilities) is formed at a time, never
[tokens, vocab] (beyond what is kept).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

KEEP_BYTES = 2**29  # what the forward may keep for the backward on a CPU (else each chunk is projected again)
KEEP_SHARE = 4  # on an accelerator: a quarter of the memory free when the head runs


def keep_budget(device: torch.device) -> int:
    """What the head's forward may keep for its backward on `device`: on an accelerator (CUDA,
    ROCm, Ascend) 1/KEEP_SHARE of its free memory, the blocks torch's allocator holds unused
    counted as free; elsewhere `KEEP_BYTES`."""
    free = _free_bytes(device)
    return KEEP_BYTES if free is None else free // KEEP_SHARE


def _free_bytes(device: torch.device) -> int | None:
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is None or not hasattr(module, "mem_get_info"):
        return None
    free, _total = module.mem_get_info(device)
    return int(free + module.memory_reserved(device) - module.memory_allocated(device))


def fusable(head: Any) -> bool:
    """Whether `head` (a model's output embeddings) is a plain linear layer whose weight this
    module may read directly: not quantized, not wrapped (LoRA), not partitioned by ZeRO-3 (whose
    gathers follow the module's own calls: `logprobs.py` keeps the module path for those)."""
    return type(head) is torch.nn.Linear and not hasattr(head.weight, "ds_id")


def head_logprobs(states: Tensor, head: torch.nn.Linear, targets: Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, chunk_tokens: int | None = None,
                  keep_bytes: int | None = None) -> tuple[Tensor, Tensor | None]:
    """logp [N] (fp32; fp64 for an fp64 head) of `targets` [N] under softmax(head(states) / T) for
    `states` [N, H], and the entropy [N] (nats, no gradient) when asked; `chunk_tokens` positions
    are projected at once (None: all), and what the backward reads is kept up to `keep_bytes`
    (None: `keep_budget` of the states' device)."""
    step = max(1, chunk_tokens or states.shape[0])
    # nothing is kept for a backward that cannot come (scoring under no_grad: the reference, the old policy)
    keep = torch.is_grad_enabled() and states.shape[0] * head.out_features * head.weight.element_size() <= (
        keep_budget(states.device) if keep_bytes is None else keep_bytes)
    logp, entropy = _HeadLogprobs.apply(states, head.weight, head.bias, targets, 1.0 / temperature, with_entropy,
                                        step, keep)
    return logp, entropy if with_entropy else None


def upcast(x: Tensor) -> Tensor:
    """Half precision to fp32 (the log-softmax needs it); fp32 and fp64 stay."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def scaled_logits(z: Tensor, inv_t: float) -> Tensor:
    """The fp32 (fp64) logits / T of a chunk; a new buffer when `z` is half precision, else `z`."""
    z = upcast(z)
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, states: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, inv_t: float,
                with_entropy: bool, step: int, keep: bool) -> tuple[Tensor, Tensor]:
        keep = keep and any(ctx.needs_input_grad[:3])
        out_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        logp = states.new_empty(states.shape[0], dtype=out_dtype)
        entropy = states.new_zeros(states.shape[0] if with_entropy else 0, dtype=out_dtype)
        lses, kept = [], []
        for a in range(0, states.shape[0], step):
            b = min(a + step, states.shape[0])
            raw = F.linear(states[a:b], weight, bias)
            z = scaled_logits(raw, inv_t)
            lse = torch.logsumexp(z, dim=-1)
            logp[a:b] = z.gather(-1, targets[a:b, None]).squeeze(-1) - lse
            lses.append(lse)
            probs = None
            if with_entropy:
                probs = (z - lse[:, None]).exp_()
                entropy[a:b] = lse - torch.einsum("nv,nv->n", probs, z)
            if keep and z is raw:  # an fp32 (fp64) head: keep the probabilities
                kept.append(probs if probs is not None else z.sub_(lse[:, None]).exp_())
            elif keep:  # a half-precision head: keep its own logits (half the bytes, exact)
                kept.append(raw)
        ctx.inv_t, ctx.step = inv_t, step
        ctx.save_for_backward(states, weight, bias, targets, torch.cat(lses) if lses else logp[:0], *kept)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Any, ...]:
        states, weight, bias, targets, lse, *kept = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(states) if want_h else None
        chunks = -(-states.shape[0] // ctx.step)
        # a half-precision weight's gradient sums its chunks' products in fp32 (each product is
        # fp32-accumulated inside the GEMM; summing ~20 of them in bf16 would round at every chunk)
        acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) and chunks > 1 else weight.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if want_b and bias is not None else None
        g = grad_logp * ctx.inv_t  # d logp / d (z / T) times the upstream gradient, with 1 / T folded in
        step = ctx.step
        for i, a in enumerate(range(0, states.shape[0], step)):
            b = min(a + step, states.shape[0])
            h, t = states[a:b], targets[a:b]
            if kept and kept[i].dtype in (torch.float32, torch.float64):
                probs = kept[i]  # overwritten: the graph is not run backward twice
            else:
                z = kept[i] if kept else F.linear(h, weight, bias)
                probs = scaled_logits(z, ctx.inv_t).sub_(lse[a:b, None]).exp_()
            grad_z = probs.mul_(-g[a:b, None])  # g (onehot - p): the p part, in place
            grad_z.scatter_add_(-1, t[:, None], g[a:b, None].to(grad_z.dtype))
            grad_z = grad_z.to(weight.dtype)
            if grad_h is not None:
                torch.mm(grad_z, weight, out=grad_h[a:b])
            if grad_w is not None and grad_w.dtype == weight.dtype:
                grad_w.addmm_(grad_z.t(), h)
            elif grad_w is not None:
                grad_w.add_(torch.mm(grad_z.t(), h))
            if grad_b is not None:
                grad_b.add_(grad_z.sum(0))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None

