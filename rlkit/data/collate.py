"""Tokenise SFT rows (loss on the response only), pad or pack them into batches.

Packing is padding-free: a micro-batch's samples lie one after another in a single row, with
``position_ids`` restarting at 0 for every sample and no attention mask. transformers keeps each
sample's attention to itself from the restarts (a block-diagonal mask for sdpa and eager, the
sequence bounds for flash-attention), and the learner's models attend one sample at a time
(``rlkit/model/attention.py``): no padding and no [T, T] mask. ``pack_bins`` (first-fit
decreasing) splits GRPO's completions into micro-batches under a token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlkit.data.images import ImageInputs
from rlkit.data.store import IGNORE_INDEX
from rlkit.data.templates import render_sft, sft_turns
from rlkit.errors import DataError


def truncate_lengths(prompt_len: int, response_len: int, cutoff_len: int) -> tuple[int, int]:
    """How many prompt and response tokens to keep so the total fits ``cutoff_len``.

    If it all fits, keep all. Otherwise the response keeps ``max(cutoff - prompt, cutoff // 2,
    1)`` tokens (at most its length) and the prompt gets the rest, so a long prompt cannot
    crowd out the response: at least one response token survives (and, for cutoff >= 2, at
    least one prompt token before it to predict it from).
    """
    if cutoff_len < 1:
        raise ValueError(f"cutoff_len must be >= 1, got {cutoff_len}")
    if prompt_len + response_len <= cutoff_len:
        return prompt_len, response_len
    r_keep = min(response_len, max(cutoff_len - prompt_len, cutoff_len // 2, 1))
    return min(prompt_len, cutoff_len - r_keep), r_keep


def encode_sft(row: dict[str, Any], tokenizer: Any, template: str, cutoff_len: int,
               mask_history: bool = False, full_lengths: list[int] | None = None,
               images: ImageInputs | None = None) -> dict[str, Any]:
    """Token ids and labels for one SFT row; labels are -100 on prompt tokens.

    Every assistant turn is a target (each one's tokens keep their labels, the turns between
    them are -100), as LLaMA-Factory trains multi-turn rows; ``mask_history`` trains the last
    turn only (earlier turns are prompt). The last response gets ``tokenizer.eos_token_id``
    appended; an earlier one keeps the template's own end-of-turn text (with the chat template,
    an eos at its end stays an eos, its trailing whitespace goes to the next prompt piece).
    Over ``cutoff_len`` (see truncate_lengths, with everything before the last response as
    the prompt) the prompt loses tokens from the left (the end, next to the response, stays),
    the last response from the right (a cut response loses its eos).
    The first prompt piece is tokenised with the tokenizer's special tokens (e.g. BOS) for the
    alpaca template, without them for the chat template (which writes its own).
    ``full_lengths``, when given, gets the row's length before truncation appended.
    A row with images (`row["images"]`) needs ``images`` (the model's processor): each piece of
    prompt is tokenised with the images it places, their marks expanded to the model's image
    tokens (never trained on); the prompt is then never cut (an image's tokens must stay whole),
    and the sample keeps its images (`images`) for the collator.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; set eos_token")
    pictures = list(row.get("images") or ())
    encode = _piece_encoder(tokenizer, images, pictures)

    eos = tokenizer.eos_token
    turns = [render_sft(row, template, tokenizer)] if mask_history else sft_turns(row, template, tokenizer)
    ids: list[int] = []
    labels: list[int] = []
    carry = ""
    for k, (prompt, response) in enumerate(turns):
        last = k == len(turns) - 1
        p_ids = encode(carry + prompt, template == "alpaca" and k == 0)
        body = response.rstrip()
        ends_eos = bool(eos) and body.endswith(eos)
        carry = response[len(body):] if ends_eos and not last else ""
        text = body[:-len(eos)] if ends_eos else response
        r_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if last or ends_eos:
            r_ids.append(tokenizer.eos_token_id)
        ids += p_ids
        labels += [IGNORE_INDEX] * len(p_ids)
        if last:
            if full_lengths is not None:
                full_lengths.append(len(ids) + len(r_ids))
            p_keep, r_keep = truncate_lengths(len(ids), len(r_ids), cutoff_len)
            if row.get("images") and p_keep < len(ids):
                raise DataError(f"its prompt with its images is {len(ids)} tokens; with the response it is past "
                                f"data.cutoff_len {cutoff_len}, and a prompt with images is not cut: raise cutoff_len")
            ids, labels, r_ids = ids[len(ids) - p_keep:], labels[len(labels) - p_keep:], r_ids[:r_keep]
        ids += r_ids
        labels += r_ids
    if not row.get("images"):
        return {"input_ids": ids, "labels": labels}
    if pictures:
        raise DataError(f"the chat template placed {len(row['images']) - len(pictures)} of the row's "
                        f"{len(row['images'])} images")
    labels = [IGNORE_INDEX if i == images.token_id else label for i, label in zip(ids, labels)]
    return {"input_ids": ids, "labels": labels, "images": list(row["images"])}


def _piece_encoder(tokenizer: Any, images: ImageInputs | None, pictures: list[Any]):
    """`encode(text, special) -> ids` for the pieces of one row: a piece that places images takes
    the next ones of `pictures` (consumed), tokenised by the processor; others by the tokenizer."""
    if pictures and images is None:
        raise DataError("the row has images but the model has no image processor (a text-only model): use a "
                        "vision-language model, or data without images")

    def encode(text: str, special: bool) -> list[int]:
        n = images.count(text) if pictures else 0
        if not n:
            return tokenizer(text, add_special_tokens=special)["input_ids"]
        if n > len(pictures):
            raise DataError(f"the chat template places {n} more images than the row has left ({len(pictures)})")
        ids = images.encode(text, pictures[:n])
        del pictures[:n]
        return ids

    return encode


def pad_collate(samples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples to the longest. Returns long tensors [B, T]: input_ids (pad_id),
    labels (-100 on padding), attention_mask (1 real, 0 pad), position_ids (0.. per row,
    0 on padding)."""
    if not samples:
        raise ValueError("pad_collate got no samples")
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "labels": torch.full((B, T), IGNORE_INDEX, dtype=torch.long),
           "attention_mask": torch.zeros((B, T), dtype=torch.long),
           "position_ids": torch.zeros((B, T), dtype=torch.long)}
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][i, :n] = torch.tensor(s["input_ids"])
        out["labels"][i, :n] = torch.tensor(s["labels"])
        out["attention_mask"][i, :n] = 1
        out["position_ids"][i, :n] = torch.arange(n)
    return out


def pack_bins(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Bins of sample indices, each bin's total length <= max_len, rows of similar length.

    First-fit-decreasing picks the number of rows k; the samples are then dealt longest-first
    to the currently shortest of k rows, so rows end at similar lengths and padding to the
    longest row is small (falls back to the first-fit bins if that would overflow).
    Deterministic: ties keep input order; indices inside a bin are in input order.
    """
    first_fit = _first_fit_decreasing(lengths, max_len)
    k = len(first_fit)
    loads, balanced = [0] * k, [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = min(range(k), key=loads.__getitem__)
        if loads[j] + lengths[i] > max_len:
            return first_fit
        balanced[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in balanced]


def _first_fit_decreasing(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    too_long = [i for i, n in enumerate(lengths) if n > max_len]
    if too_long:
        raise ValueError(f"sample {too_long[0]} has {lengths[too_long[0]]} tokens, more than "
                         f"max_len={max_len}; set cutoff_len <= max_len")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((j for j, f in enumerate(free) if f >= lengths[i]), None)
        if b is None:
            bins.append([])
            free.append(max_len)
            b = len(bins) - 1
        bins[b].append(i)
        free[b] -= lengths[i]
    return [sorted(b) for b in bins]


def pack_collate(samples: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """The samples one after another in one padding-free row: long tensors [1, T], T = their total
    length: input_ids, labels and position_ids (0.. for every sample). The first label of every
    sample is -100, so no token is trained to predict the next sample's first token."""
    if not samples:
        raise ValueError("pack_collate got no samples")
    ids, labels, positions = [], [], []
    for s in samples:
        n = len(s["input_ids"])
        ids += s["input_ids"]
        labels += [IGNORE_INDEX] + list(s["labels"][1:n])
        positions += range(n)
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions])}


def padding_free(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's input of right-padded rows [b, l] as one padding-free row: `input_ids` and
    `position_ids` [1, T] hold the rows' real tokens one after another (T = their total length;
    the positions restart per row, so the model attends within each; no attention mask), and
    `unpack` long [b, l] gives each row's position its place in the packed row (-1 past its end),
    which `rlkit.learner.logprobs.token_logprobs` reads to return its logprobs in the padded layout."""
    lengths = attention_mask.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    steps = torch.arange(attention_mask.shape[1])
    real = steps[None, :] < lengths[:, None]
    unpack = torch.where(real, starts[:, None] + steps[None, :], torch.full_like(real, -1, dtype=torch.long))
    return {"input_ids": input_ids[real][None, :], "position_ids": steps.expand_as(real)[real][None, :],
            "unpack": unpack}
