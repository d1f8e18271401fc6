"""KTO's objective: unpaired rows (a prompt, one completion, desirable or not) scored through
rlkit's head, the reference's logprobs attached by the learner (the frozen copy, or the policy with
its LoRA adapters disabled), and TRL's `KTOTrainer` loss on them (`rlkit.dpo.loss.kto_loss`).

A micro-batch of N rows (`unpaired_batch`): `input_ids`, `attention_mask`, `completion_mask` of the
N rows and, for `loss_type: kto`, N more rows after them: row i's prompt with the completion of
row i - 1 of the micro-batch (the first takes the last's), TRL's mismatched pairs for the KL
estimate, so that they hold the same completions as the rows they estimate it for. `label` [N].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlkit.dpo.loss import kto_loss
from rlkit.dpo.objective import cut, padded_rows
from rlkit.learner.logprobs import token_logprobs

KEYS = ("input_ids", "attention_mask", "completion_mask")


def unpaired_batch(rows: list[dict[str, Any]], pad_id: int, kl: bool = True,
                   cutoff_len: int | None = None) -> dict[str, Tensor]:
    """[N, L] (with `kl`, [2N, L]) tensors of N tokenised rows (`prompt_ids`, `completion_ids`,
    `label`), right-padded, a KL row cut to `cutoff_len` as the rows were, and `label` [N]."""
    seqs = [(r["prompt_ids"], r["completion_ids"]) for r in rows]
    if kl:  # a KL row kept within cutoff_len as TRL's collator keeps it: its first tokens
        limit = cutoff_len or 1 << 30
        seqs += [cut(rows[i]["prompt_ids"], rows[i - 1]["completion_ids"], limit, "keep_start")
                 for i in range(len(rows))]
    return {**padded_rows(seqs, pad_id), "label": torch.tensor([bool(r["label"]) for r in rows])}


@dataclass(frozen=True)
class KTOObjective:
    """TRL's KTO loss of a micro-batch (`unpaired_batch`'s layout): each row's completion logprob
    (its sum) against the reference's; for `kto` the KL estimate is the mean over the KL rows of
    policy minus reference (the policy's without gradients), clamped at 0. Metrics summed over the
    micro-batch: `kto_loss`'s sums, `loss` (times the rows), `rows`, `batches` and `tokens`."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    temperature: float = 1.0
    needs: tuple[str, ...] = ("ref_logp",)

    def positions(self, batch: Any) -> Tensor:
        return batch["completion_mask"][:, 1:] != 0

    def __call__(self, model: Any, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        positions, label = self.positions(batch), batch["label"].bool()
        n = label.shape[0]
        rows = {k: batch[k][:n] for k in KEYS}
        logp, _ = token_logprobs(model, rows, positions=positions[:n])
        ref = batch["ref_logp"].to(logp.dtype) * positions
        kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
        if self.loss_type == "kto":
            with torch.no_grad():
                kl_logp, _ = token_logprobs(model, {k: batch[k][n:] for k in KEYS}, positions=positions[n:])
            kl = (kl_logp.sum(dim=1) - ref[n:].sum(dim=1)).mean().clamp(min=0)
        loss, sums = kto_loss(self.loss_type, self.beta, logp.sum(dim=1), ref[:n].sum(dim=1), label, kl,
                              self.desirable_weight, self.undesirable_weight)
        return loss, {**sums, "loss": loss.detach() * n, "rows": n, "batches": 1, "tokens": positions[:n].sum()}


def kto_means(sums: dict[str, float]) -> dict[str, float]:
    """The learner's summed metrics of `KTOObjective` as TRL's `KTOTrainer` logs them: each side's
    mean reward and logprob, their margin, the mean KL estimate, the rows of each side."""
    chosen, rejected = sums.get("count/chosen", 0), sums.get("count/rejected", 0)
    out = {"loss": sums["loss"] / max(sums.get("rows", 0), 1), "kl": sums["kl"] / max(sums.get("batches", 0), 1),
           "count/chosen": chosen, "count/rejected": rejected}
    for side, count in (("chosen", chosen), ("rejected", rejected)):
        if count:
            out[f"rewards/{side}"] = sums[f"rewards/{side}_sum"] / count
            out[f"logps/{side}"] = sums[f"logps/{side}_sum"] / count
    if chosen and rejected:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
