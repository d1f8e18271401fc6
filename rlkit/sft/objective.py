"""The SFT objective: next-token NLL on the response tokens (labels != -100)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def token_nll(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed next-token NLL (nats) over labels != -100, and that token count.
    logits [B, T, V], labels [B, T]."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    n = (shift_labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, n


@dataclass(frozen=True)
class NLLObjective:
    """Token-mean NLL of each micro-batch. Metrics: `nll` (summed nats) and `tokens` (loss tokens),
    so the mean over any set of micro-batches is sum(nll) / sum(tokens)."""

    temperature: float = 1.0
    needs: tuple[str, ...] = ()

    def __call__(self, model: Any, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        if "position_ids" in batch:  # packed rows: positions restart per sample
            kwargs["position_ids"] = batch["position_ids"]
        nll, n = token_nll(model(**kwargs, use_cache=False).logits, batch["labels"])
        return nll / n.clamp(min=1), {"nll": nll.detach(), "tokens": n}
