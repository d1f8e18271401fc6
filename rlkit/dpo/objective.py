"""The preference objective the learner steps: chosen and rejected rows of a micro-batch in one
forward, their completion tokens scored through rlkit's head (`token_logprobs`: no [rows, length,
vocab] logits), the reference's logprobs attached by the learner (`needs`: the frozen copy, or the
policy with its LoRA adapters disabled), and TRL's DPO loss on them (`loss.dpo_loss`).

A micro-batch holds B pairs as TRL's `DataCollatorForPreference` lays them out: `input_ids`,
`attention_mask` and `completion_mask` [2B, L], the B chosen rows first, then the B rejected
rows in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlkit.data.collate import padding_free
from rlkit.dpo.loss import REFERENCE_FREE, DPOTerms, cpo_loss, dpo_loss, orpo_loss, sequence_logps
from rlkit.learner.logprobs import logprobs_and_sum_sq, token_logprobs

# DPO's metrics, summed over the pairs of a micro-batch (the driver divides by `pairs`)
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


@dataclass(frozen=True)
class DPOObjective:
    """TRL's DPO loss (`terms`: loss types and weights, beta, f-divergence, LD-DPO, WPO's weights
    from each position's sum of squared probabilities) of each micro-batch, the mean over its
    pairs, against the reference's logprobs the learner attaches (`needs`) or the batch's
    `ref_logps` (computed before training: `needs` empty); metrics: each of `PAIR_METRICS` summed
    over the pairs, `pairs`, `loss` (the loss times the pairs) and `tokens` (completion tokens)."""

    terms: DPOTerms = DPOTerms()
    temperature: float = 1.0
    needs: tuple[str, ...] = ("ref_logp",)

    def positions(self, batch: Any) -> Tensor:
        """The completion tokens (shifted space: the positions that predict them)."""
        return batch["completion_mask"][:, 1:] != 0

    def __call__(self, model: Any, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        positions = self.positions(batch)
        sum_sq = None
        if self.terms.use_weighting:
            logp, sum_sq = logprobs_and_sum_sq(model, batch, positions)
        else:
            logp, _ = token_logprobs(model, batch, positions=positions)
        mask = batch["completion_mask"]
        if "ref_logps" in batch:  # the reference's sequence logprobs, computed before training
            ref = batch["ref_logps"].to(logp.dtype)
        else:
            ref = sequence_logps(batch["ref_logp"].to(logp.dtype) * positions, mask, self.terms.ld_alpha)
        loss, metrics = dpo_loss(self.terms, logp, mask, ref, sum_sq)
        pairs = mask.shape[0] // 2
        sums = {k: metrics[k] * pairs for k in PAIR_METRICS}
        return loss, {**sums, "pairs": pairs, "loss": loss.detach() * pairs, "tokens": positions.sum()}


@dataclass(frozen=True)
class ReferenceFreeObjective:
    """ORPO (`loss_type` "orpo"), SimPO ("simpo") or CPO ("cpo") as TRL's experimental ORPO and
    CPO trainers compute them, with no reference: each side's completion logprob (its token mean
    for orpo and simpo, its sum for cpo) and the chosen side's NLL, the mean over the micro-batch's
    chosen tokens (the completions', and for ORPO the prompts' too, as TRL computes it). Metrics as
    `DPOObjective`'s, with `nll_loss` (and ORPO's `log_odds_ratio`, `log_odds_chosen`)."""

    loss_type: str = "orpo"
    beta: float = 0.1
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    label_smoothing: float = 0.0
    temperature: float = 1.0
    needs: tuple[str, ...] = ()

    def positions(self, batch: Any) -> Tensor:
        """The completion tokens; for ORPO every token after the first (TRL's ORPO NLL covers the prompt)."""
        return batch["attention_mask" if self.loss_type == "orpo" else "completion_mask"][:, 1:] != 0

    def __call__(self, model: Any, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        positions, completion = self.positions(batch), batch["completion_mask"][:, 1:] != 0
        logp, _ = token_logprobs(model, batch, positions=positions)
        sums, lengths = (logp * completion).sum(dim=1), completion.sum(dim=1).clamp(min=1)
        pairs = sums.shape[0] // 2
        nll = -(logp[:pairs] * positions[:pairs]).sum() / positions[:pairs].sum()  # TRL's chosen cross entropy
        sides = sums / lengths if REFERENCE_FREE[self.loss_type] else sums
        chosen, rejected = sides.chunk(2)
        if self.loss_type == "orpo":
            loss, metrics = orpo_loss(chosen, rejected, nll, self.beta)
        else:
            loss, metrics = cpo_loss("simpo" if self.loss_type == "simpo" else "sigmoid", chosen, rejected, nll,
                                     self.beta, self.cpo_alpha, self.simpo_gamma, self.label_smoothing)
        metrics = {**metrics, "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean()}
        return loss, {**{k: v * pairs for k, v in metrics.items()}, "pairs": pairs, "loss": loss.detach() * pairs,
                      "tokens": positions.sum()}


def pair_means(sums: dict[str, float]) -> dict[str, float]:
    """The learner's summed metrics of a preference objective as TRL logs them: means over the pairs."""
    pairs = max(sums.get("pairs", 0), 1)
    return {k: v / pairs for k, v in sums.items() if k not in ("pairs", "tokens")}


def cut(prompt: list[int], response: list[int], cutoff_len: int, mode: str) -> tuple[list[int], list[int]]:
    """Prompt + response cut to `cutoff_len` as TRL's collators cut them: `keep_start` keeps the
    first tokens (the response loses its end), `keep_end` the last (the prompt its start)."""
    if len(prompt) + len(response) <= cutoff_len:
        return prompt, response
    if mode == "keep_start":
        return prompt, response[:max(0, cutoff_len - len(prompt))]
    over = len(prompt) + len(response) - cutoff_len
    return prompt[over:], response[max(0, over - len(prompt)):]


def padded_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    """`input_ids`, `attention_mask` and `completion_mask` [N, L] of N (prompt, completion) token
    rows, right-padded to the longest; `completion_mask` 1 on each completion's tokens."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention[i, :len(p) + len(c)] = 1
        completion[i, len(p):len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def preference_batch(pairs: list[dict[str, list[int]]], pad_id: int) -> dict[str, Tensor]:
    """[2B, L] tensors of B tokenised pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`; a side cut
    on its own has its prompt as `chosen_prompt` / `rejected_prompt`): the chosen rows, then the
    rejected ones (`padded_rows`); `margin` [B] where the pairs carry one (TRL's reward-model
    margin), `ref_logps` [2B] where they carry the reference's (`ref_chosen`, `ref_rejected`)."""
    out = padded_rows([(p.get(f"{side}_prompt", p.get("prompt_ids")), p[f"{side}_ids"])
                       for side in ("chosen", "rejected") for p in pairs], pad_id)
    if all("margin" in p for p in pairs):
        out["margin"] = torch.tensor([float(p["margin"]) for p in pairs])
    if all("ref_chosen" in p for p in pairs):
        out["ref_logps"] = torch.tensor([p[f"ref_{side}"] for side in ("chosen", "rejected") for p in pairs])
    return out


def without_padding(collate: Callable[[list[dict], int], dict[str, Tensor]]) -> Callable[[list[dict], int], dict]:
    """`collate` with the model's input of its rows padding-free (`rlkit.data.collate.padding_free`:
    one row, positions restarting per sequence); the masks and the loss keep the padded layout."""

    def packed(rows: list[dict], pad_id: int) -> dict[str, Tensor]:
        out = collate(rows, pad_id)
        return {**out, **padding_free(out["input_ids"], out["attention_mask"])}

    return packed
