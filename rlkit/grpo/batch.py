"""One GRPO step's training data as one typed batch, and how it is cut for the learners
(pure: torch only, no Ray/vLLM).

Rows are prompt-major: completions `[i*G, (i+1)*G)` answer prompt `i`. Each row is prompt
tokens + completion tokens; `completion_mask` marks the completion tokens that count in the
loss (not the tool results inside a multi-turn completion: TRL's `tool_mask`). The driver
builds a `GRPOBatch`, plans mini/micro-batches, and sends each learner its `shards` once (all
optimizer steps of the step); the learners compute what else they need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlkit.learner.objective import MicroBatch, step_normaliser


@dataclass(frozen=True)
class Rollout:
    """What the driver keeps of one completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool  # hit max_tokens without a stop
    logprobs: list[float] | None = None  # the sampling engine's logprob of each completion token
    policy_version: int = 0  # the policy version (optimizer steps synced) whose weights generated it
    tool_mask: list[int] | None = None  # multi-turn: 0 on tool-result tokens (no loss), else 1
    images: tuple = ()  # the prompt's images (paths or PIL images), whose tokens prompt_ids holds expanded
    forks: tuple[Rollout, ...] = ()  # an agent program's earlier samples of this rollout: its reward, advantage
    versions: tuple[int, ...] = ()  # streamed: the policy version that sampled each token (policy_version: the oldest)


def expand_forks(rollouts: Sequence[Rollout], advantages: Tensor) -> tuple[list[Rollout], Tensor]:
    """The rollouts with their forks before them, each fork with its rollout's advantage."""
    if not any(r.forks for r in rollouts):
        return list(rollouts), advantages
    out = [part for r in rollouts for part in (*r.forks, r)]
    counts = torch.tensor([len(r.forks) + 1 for r in rollouts])
    return out, advantages.repeat_interleave(counts, dim=0)


@dataclass(frozen=True)
class GRPOBatch:
    """B rows, right-padded to L. `engine_logp` [B, L-1] (shifted space: position t scores
    token t+1) holds the sampling engine's logprobs of the completion tokens (0 elsewhere), for the
    rollout correction and the mismatch metrics."""

    input_ids: Tensor  # long [B, L]
    attention_mask: Tensor  # long [B, L]
    completion_mask: Tensor  # long [B, L]
    advantages: Tensor  # float [B]
    engine_logp: Tensor | None = None  # float [B, L-1]
    teacher_logp: Tensor | None = None  # float [B, L-1]: a distillation teacher's actor's, when it has its own
    images: tuple | None = None  # each row's images, when a row has any
    pixels: Any = None  # rlkit.data.images.ImageInputs: the rows' images -> the model's pixel inputs

    @classmethod
    def collate(cls, rollouts: Sequence[Rollout], advantages: Tensor, pad_id: int,
                mask_truncated: bool = False, pixels: Any = None) -> GRPOBatch:
        """Pad the rollouts. With `mask_truncated`, truncated completions get an all-zero completion
        mask (no loss). The engine's sampling logprobs are kept when every rollout has them. Rows
        with images need `pixels` (the model's processor): micro-batches then carry their pixels.
        A completion in which the policy sampled the model's image mark gets no loss, and the mark
        is padding in its input: the model would look for an image that is not there (its reward
        still counts in its group)."""
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        B = len(rollouts)
        ids = torch.full((B, length), pad_id, dtype=torch.long)
        attn = torch.zeros((B, length), dtype=torch.long)
        comp = torch.zeros((B, length), dtype=torch.long)
        mark = pixels.token_id if pixels is not None else None
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            ids[i, :p + c] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
            attn[i, :p + c] = 1
            sampled_mark = mark is not None and mark in r.completion_ids
            if sampled_mark:
                ids[i, p:p + c] = ids[i, p:p + c].masked_fill(ids[i, p:p + c] == mark, pad_id)
            if not (mask_truncated and r.truncated) and not sampled_mark:
                comp[i, p:p + c] = 1 if r.tool_mask is None else torch.tensor(r.tool_mask, dtype=torch.long)
        old = None
        if all(r.logprobs is not None for r in rollouts):
            old = torch.zeros((B, length - 1), dtype=torch.float32)
            for i, r in enumerate(rollouts):
                if r.logprobs is None or len(r.logprobs) != len(r.completion_ids):
                    raise ValueError(f"rollout {i}: needs one sampling logprob per completion token")
                p = len(r.prompt_ids)
                old[i, p - 1:p - 1 + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        images = tuple(r.images for r in rollouts) if any(r.images for r in rollouts) else None
        if images and pixels is None:
            raise ValueError("rollouts with images need the model's processor (pixels)")
        return cls(ids, attn, comp, advantages.to(torch.float32), old, images=images, pixels=pixels if images else None)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batch(self, rows: Sequence[int]) -> MicroBatch:
        """The learner's tensors for `rows`, trimmed to their longest sequence. Keys: input_ids,
        attention_mask, completion_mask [b, l], advantages [b], engine_logp and teacher_logp
        [b, l-1] when the batch has them."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        length = int(self.attention_mask[idx].sum(1).max())
        out = {"input_ids": self.input_ids[idx, :length], "attention_mask": self.attention_mask[idx, :length],
               "completion_mask": self.completion_mask[idx, :length], "advantages": self.advantages[idx]}
        for key in ("engine_logp", "teacher_logp"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)[idx, :length - 1]
        if self.images is not None:
            out.update(self.pixels.pixels([self.images[i] for i in idx.tolist()], out["input_ids"]))
        return MicroBatch(out)

    def packed_micro_batch(self, rows: Sequence[int]) -> MicroBatch:
        """`micro_batch(rows)` with the model's input padding-free: `input_ids` and `position_ids`
        [1, T] hold the rows' sequences one after another (T = their total length; the positions
        restart per sequence, so the model attends within each; no attention mask), and `unpack`
        long [b, l] gives, for each row's position, its place in the packed row (-1 past its end).
        completion_mask, advantages and engine_logp keep the padded [b, l] layout (the loss's).
        Not for rows with images (their pixels follow the padded rows)."""
        if self.images is not None:
            raise ValueError("rows with images are not packed: plan padded micro-batches")
        from rlkit.data.collate import padding_free

        padded = dict(self.micro_batch(rows))
        mask = padded.pop("attention_mask")
        return MicroBatch({**padded, **padding_free(padded["input_ids"], mask)})

    def completion_tokens(self, rows: Sequence[int] | None = None) -> int:
        """Loss tokens (shifted space: positions 1..L-1) of `rows` (all rows by default)."""
        mask = self.completion_mask[:, 1:] if rows is None else self.completion_mask[list(rows), 1:]
        return int(mask.sum())

    def scored(self, score: Callable[[list[MicroBatch]], list[Tensor]], rows: int) -> GRPOBatch:
        """This batch with `teacher_logp` [B, L-1]: `score` (a distillation teacher's) of its
        micro-batches of `rows` rows, tokens and masks only."""
        spans = [range(i, min(i + rows, len(self))) for i in range(0, len(self), rows)]
        keys = ("input_ids", "attention_mask", "completion_mask")
        parts = score([MicroBatch({k: mb[k] for k in keys}) for mb in map(self.micro_batch, spans)])
        logp = torch.zeros(self.input_ids.shape[0], self.input_ids.shape[1] - 1)
        for span, part in zip(spans, parts):
            logp[span.start:span.stop, :part.shape[1]] = part
        return dataclasses.replace(self, teacher_logp=logp)

    def shards(self, plan: list[list[list[list[int]]]], packed: bool = False) -> list[list[list[MicroBatch]]]:
        """Micro-batches per [rank][optimizer step][micro-batch] from a `plan_micro_batches` or
        `plan_token_micro_batches` plan ([step][rank][micro-batch] row indices), padded or `packed`
        (`packed_micro_batch`). Every micro-batch also carries the step's DAPO normaliser
        `num_items_in_batch` (the step's loss tokens over all ranks, see `step_normaliser`)."""
        world = len(plan[0])
        shards: list[list[list[MicroBatch]]] = [[] for _ in range(world)]
        for step in plan:
            grad_accum = len(step[0])
            tokens = self.completion_tokens([i for rank_rows in step for rows in rank_rows for i in rows])
            norm = torch.tensor(step_normaliser(tokens, world, grad_accum), dtype=torch.float64)
            for r, rank_rows in enumerate(step):  # rank r's micro-batches (row index lists) of this step
                make = self.packed_micro_batch if packed else self.micro_batch
                shards[r].append([MicroBatch({**make(rows), "num_items_in_batch": norm}) for rows in rank_rows])
        return shards


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


def plan_token_micro_batches(lengths: Sequence[int], mini_batches: int, world: int, budget: int,
                             seed: int) -> list[list[list[list[int]]]]:
    """Row indices per [mini-batch][rank][micro-batch] (verl's dynamic batch size): the rows are
    shuffled with `seed` and dealt to mini-batches and ranks as `plan_micro_batches` does, then
    each rank's share is packed into micro-batches of at most `budget` tokens (`lengths[i]`: row
    i's prompt + completion; first-fit decreasing, as SFT packing). Every rank of a mini-batch
    takes as many micro-batches as the rank that needs the most (ZeRO-2/3 reduce gradients and
    gather parameters at every micro-batch, on all ranks at once): the others split their fullest
    micro-batches until they have as many."""
    from rlkit.data.collate import pack_bins

    n = len(lengths)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    per_mini = n // mini_batches
    per_rank = per_mini // world
    plan = []
    for m in range(mini_batches):
        shares = [perm[m * per_mini + r * per_rank:m * per_mini + (r + 1) * per_rank] for r in range(world)]
        ranks = [[[rows[i] for i in b] for b in pack_bins([lengths[i] for i in rows], budget)] for rows in shares]
        k = max(len(bins) for bins in ranks)
        for bins in ranks:
            while len(bins) < k:  # split the fullest micro-batch of two rows or more in two
                j = max((j for j, b in enumerate(bins) if len(b) > 1), key=lambda j: sum(lengths[i] for i in bins[j]))
                half = len(bins[j]) // 2
                bins[j:j + 1] = [bins[j][:half], bins[j][half:]]
        plan.append(ranks)
    return plan
