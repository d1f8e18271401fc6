"""Turn scored rollouts into learner micro-batches (pure: torch only, no Ray/vLLM).

Samples are prompt-major: completions `[i*G, (i+1)*G)` answer prompt `i`. Each training row
is prompt tokens + completion tokens; `completion_mask` marks the completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rollout:
    """What the driver keeps of one completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool  # hit max_tokens without a stop
    logprobs: list[float] | None = None  # the sampling engine's logprob of each completion token


def collate(rollouts: Sequence[Rollout], advantages: torch.Tensor, pad_id: int,
            mask_truncated: bool = False, behaviour_logp: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids, attention_mask, completion_mask [B, L]; advantages [B].

    With `mask_truncated`, truncated completions get an all-zero completion mask (no loss).
    With `behaviour_logp`, also `old_logp` [B, L-1] (shifted space) from the engine's sampling
    logprobs: the importance-ratio denominator when rollouts come from an older policy.
    """
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    B = len(rollouts)
    ids = torch.full((B, length), pad_id, dtype=torch.long)
    attn = torch.zeros((B, length), dtype=torch.long)
    comp = torch.zeros((B, length), dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids[i, :p + c] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
        attn[i, :p + c] = 1
        if not (mask_truncated and r.truncated):
            comp[i, p:p + c] = 1
    out = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp,
           "advantages": advantages.to(torch.float32)}
    if behaviour_logp:
        old = torch.zeros((B, length - 1), dtype=torch.float32)
        for i, r in enumerate(rollouts):
            if r.logprobs is None or len(r.logprobs) != len(r.completion_ids):
                raise ValueError(f"rollout {i}: needs one sampling logprob per completion token")
            p = len(r.prompt_ids)
            old[i, p - 1:p - 1 + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        out["old_logp"] = old
    return out


def slice_batch(batch: dict[str, torch.Tensor], index: Sequence[int]) -> dict[str, torch.Tensor]:
    """Rows `index` of every tensor, trimmed to the longest remaining sequence."""
    idx = torch.as_tensor(list(index), dtype=torch.long)
    out = {k: v[idx] for k, v in batch.items()}
    length = int(out["attention_mask"].sum(1).max())
    for k, v in out.items():
        if v.dim() == 2:
            out[k] = v[:, :length if k in ("input_ids", "attention_mask", "completion_mask") else length - 1]
    return out


def plan_micro_batches(n: int, mini_batches: int, world: int, micro: int, seed: int) -> list[list[list[list[int]]]]:
    """Row indices per [mini-batch][rank][micro-batch], shuffled with `seed`.

    The config guarantees `n` splits into `mini_batches` x `world` x k micro-batches of `micro`.
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    per_mini = n // mini_batches
    per_rank = per_mini // world
    plan = []
    for m in range(mini_batches):
        rows = perm[m * per_mini:(m + 1) * per_mini]
        plan.append([[rows[r * per_rank + j:r * per_rank + j + micro] for j in range(0, per_rank, micro)]
                     for r in range(world)])
    return plan


def completion_tokens(micro_batches: Iterable[dict[str, torch.Tensor]]) -> int:
    """Completion (loss) tokens in shifted space over micro-batches, for DAPO's token normaliser."""
    return sum(int(mb["completion_mask"][:, 1:].sum()) for mb in micro_batches)
