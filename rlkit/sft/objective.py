"""The SFT objective: next-token NLL on the response tokens (labels != -100)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlkit.learner.logprobs import token_logprobs


@dataclass(frozen=True)
class NLLObjective:
    """NLL of the labelled tokens. In training (a micro-batch with `num_items_in_batch`, which
    `shard_step` sets) TRL's reduction: the summed NLL over the labelled tokens of the whole optimizer
    step on all ranks (transformers' `num_items_in_batch`, with TRL's default
    `average_tokens_across_devices`), whatever each micro-batch holds; without it (eval, a lone
    micro-batch) the micro-batch's token mean. Metrics: `nll` (summed nats) and `tokens` (loss
    tokens), so the mean over any set of micro-batches is sum(nll) / sum(tokens). Only the labelled
    positions are scored (`token_logprobs`: no [B, T, vocab] logits); a label is its input token
    (`encode_sft`), so the next input token is the target."""

    temperature: float = 1.0
    needs: tuple[str, ...] = ()

    def positions(self, batch: dict[str, Tensor]) -> Tensor:
        """The labelled tokens (shifted space)."""
        return batch["labels"][:, 1:] != -100

    def __call__(self, model: Any, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        positions = self.positions(batch)
        logp, _ = token_logprobs(model, batch, positions=positions)
        nll, n = -logp.sum(), positions.sum()
        items = batch.get("num_items_in_batch")
        loss = nll / (n.clamp(min=1) if items is None else items.to(nll.dtype))
        return loss, {"nll": nll.detach(), "tokens": n}

