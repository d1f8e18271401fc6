"""Learner-side GRPO pieces: per-token logprobs of completions and the reference policy.

A rollout batch is a dict of tensors: `input_ids` [B, L] (prompt + completion, right-padded),
`attention_mask` [B, L], `completion_mask` [B, L] (1 on completion tokens), `advantages` [B];
optional `old_logp` / `ref_logp` [B, L-1]. Logprobs are in shifted space: position t scores
token t+1 from logits at t, so masks are `completion_mask[:, 1:]`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from rlkit.grpo.loss import entropy_from_logits, selective_log_softmax


def completion_logprobs(model: Any, batch: dict[str, torch.Tensor], temperature: float,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp [B, L-1] of each next token under `logits / temperature` (what vLLM reports with
    processed logprobs and top_p=1), and the per-token entropy when asked."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    logp = selective_log_softmax(logits, batch["input_ids"][:, 1:])
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    return logp, entropy


class Reference:
    """The frozen reference policy for the KL term.

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
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        if self.copy is not None:
            return completion_logprobs(self.copy, batch, temperature)[0]
        inner = self.policy.module if hasattr(self.policy, "module") else self.policy
        ctx = inner.disable_adapter() if hasattr(inner, "disable_adapter") else nullcontext()
        with ctx:
            return completion_logprobs(self.policy, batch, temperature)[0]
