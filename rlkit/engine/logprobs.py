"""Token log-probabilities of a causal LM, and the frozen reference policy (torch only).

A batch is a dict of tensors: `input_ids` [B, L] (right-padded), `attention_mask` [B, L].
Logprobs are in shifted space: position t scores token t+1 from the logits at t, so they are
[B, L-1]; a stage picks its positions with its own mask (GRPO: `completion_mask[:, 1:]`).
With `temperature` the logits are divided by it first: the same numbers vLLM reports with
`processed_logprobs` and top_p 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def token_logprobs(model: Any, batch: dict[str, Tensor], temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """logp [B, L-1] of each next token under `logits / temperature`, and the per-token entropy
    [B, L-1] (nats, no grad) when asked."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    logp = selective_log_softmax(logits, batch["input_ids"][:, 1:])
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    return logp, entropy


class Reference:
    """The frozen reference policy (the starting model) for KL terms.

    Full fine-tuning: a separate frozen copy of the starting model on this rank. LoRA/QLoRA:
    the policy itself with its adapters disabled (no second copy).
    """

    def __init__(self, policy: Any, finetuning: str, load_copy: Any):
        self.policy = policy
        self.copy = None
        if finetuning == "full":
            self.copy = load_copy().eval()
            self.copy.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Tensor], temperature: float = 1.0) -> Tensor:
        """`token_logprobs` under the reference policy."""
        if self.copy is not None:
            return token_logprobs(self.copy, batch, temperature)[0]
        inner = self.policy.module if hasattr(self.policy, "module") else self.policy
        ctx = inner.disable_adapter() if hasattr(inner, "disable_adapter") else nullcontext()
        with ctx:
            return token_logprobs(self.policy, batch, temperature)[0]



def selective_log_softmax(logits: Tensor, ids: Tensor) -> Tensor:
    """log_softmax(logits)[..., ids]: [B, T, V] x long [B, T] -> [B, T], without a [B, T, V] copy.

    fp32/fp64: gathered logit minus a per-row logsumexp; bf16/fp16: per-row log_softmax (the
    logsumexp form is inaccurate in half precision). Matches TRL's ``selective_log_softmax``.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"ids shape {tuple(ids.shape)} != logits leading shape {tuple(logits.shape[:-1])}")
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    return torch.stack(
        [F.log_softmax(row, dim=-1).gather(-1, r_ids.unsqueeze(-1)).squeeze(-1) for row, r_ids in zip(logits, ids)]
    )


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Shannon entropy in nats over the last axis: [..., V] -> [...], ``chunk_size`` rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        parts.append(-(logps.exp() * logps).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])
