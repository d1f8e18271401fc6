"""Token log-probabilities of a causal LM, and the frozen reference policy (torch only).

A batch is a dict of tensors: `input_ids` [B, L] right-padded with `attention_mask` [B, L], or a
padding-free row [1, T] with `position_ids` restarting per sequence and no mask (each sequence
attends within itself, `attention.py`). Logprobs are in
shifted space: position t scores token t+1 from the logits at t, so they are [B, L-1]; a stage
picks its positions with its own mask (GRPO: `completion_mask[:, 1:]`) and may pass them as
`positions`, so that only those are scored. With `temperature` the logits are divided by it
first: the same numbers vLLM reports with `processed_logprobs` and top_p 1.

The [B, L, vocab] logits are never formed: the model runs to its last hidden state (the
lm_head on one position only), then the lm_head, the log-softmax and the entropy run over the
wanted positions in chunks of `chunk_elements // vocab` tokens, each chunk recomputed in the
backward pass (activation checkpointing) rather than kept. With a 152k vocabulary the fp32
logits of one 8k-token sequence are ~5 GB; a chunk is 256 MiB. A model that changes its logits
after the lm_head (Gemma 2's soft-capping, Cohere's scale) is detected on its first call and
takes the full-logits path.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlkit.learner.head import fusable, head_logprobs, scaled_logits, upcast
from rlkit.model.attention import sequence_bounds

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 2**26  # logits elements per chunk (fp32: 256 MiB)
_HEAD_ONLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> its logits are lm_head(h)


def token_logprobs(model: Any, batch: dict[str, Tensor], temperature: float = 1.0, with_entropy: bool = False,
                   positions: Tensor | None = None, chunk_elements: int = CHUNK_ELEMENTS,
                   keep_bytes: int | None = None) -> tuple[Tensor, Tensor | None]:
    """logp [B, L-1] of each next token under `logits / temperature`, and the per-token entropy
    [B, L-1] (nats, no grad) when asked; fp32 (fp64 for an fp64 model). Only `positions` (bool
    [B, L-1]; default: every position whose next token is not padding) are scored, the rest are 0."""
    if "unpack" in batch:
        return _packed_logprobs(model, batch, temperature, with_entropy, positions, chunk_elements, keep_bytes)
    ids = batch["input_ids"]
    if positions is None:
        mask = batch["attention_mask"]
        positions = (mask[:, 1:] != 0) if mask.dim() == 2 else torch.ones_like(ids[:, 1:], dtype=torch.bool)
    hf = _hf_model(model)
    head = hf.get_output_embeddings()
    if _HEAD_ONLY.get(hf) is False:
        return _full_logits_path(model, hf, batch, temperature, with_entropy, positions)
    hidden, last_logits = _last_hidden(model, hf, batch)
    if _HEAD_ONLY.get(hf) is None:  # the first call: are the model's logits its lm_head's output?
        _HEAD_ONLY[hf] = _same_logits(head(hidden[:, -1:]), last_logits)
        if not _HEAD_ONLY[hf]:
            log.warning("%s changes its logits after the lm_head: token logprobs take the full-logits path",
                        type(hf).__name__)
            return _full_logits_path(model, hf, batch, temperature, with_entropy, positions)
    rows = positions.nonzero(as_tuple=True)
    scored, entropy = score_states(hidden[:, :-1][rows], ids[:, 1:][rows], head, temperature, with_entropy,
                                   chunk_elements, keep_bytes)
    logp = ids.new_zeros(positions.shape, dtype=scored.dtype).index_put(rows, scored)
    return logp, ids.new_zeros(positions.shape, dtype=scored.dtype).index_put(rows, entropy) if with_entropy else None


def score_states(states: Tensor, targets: Tensor, head: Any, temperature: float = 1.0, with_entropy: bool = False,
                 chunk_elements: int = CHUNK_ELEMENTS, keep_bytes: int | None = None) -> tuple[Tensor, Tensor]:
    """logp [N] of `targets` [N] under softmax(head(states) / T) for final hidden states [N, H],
    and the entropy [N] (no grad; zeros unless asked): rlkit's fused head (`head.py`) where the
    lm_head is a plain linear layer, else the module's own call on chunks of `chunk_elements //
    vocab` positions, each recomputed in the backward pass."""
    step = max(1, chunk_elements // head.out_features)
    if fusable(head):
        scored, entropy = head_logprobs(states, head, targets, temperature, with_entropy, step, keep_bytes)
        return scored, entropy if entropy is not None else scored.new_zeros(scored.shape)

    def score(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        logits = scaled_logits(head(h), 1.0 / temperature)  # in place where it can be; no copy at 1.0
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
        with torch.no_grad():
            entropy = lse - (logits.softmax(-1) * logits).sum(-1) if with_entropy else torch.zeros_like(lse)
        return logp, entropy

    grad = torch.is_grad_enabled() and states.requires_grad
    chunks = list(zip(states.split(step), targets.split(step)))
    chunks += [(states[:0], targets[:0])] * (head_calls_on_every_rank(len(chunks), head, states.device) - len(chunks))
    parts = [checkpoint(score, h, t, use_reentrant=False) if grad else score(h, t) for h, t in chunks]
    if not parts:
        empty = upcast(states[:0, 0])
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]).detach()


def logprobs_and_sum_sq(model: Any, batch: dict[str, Tensor], positions: Tensor,
                        chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """`token_logprobs` at temperature 1 (padded or padding-free batches) and, at the same
    positions, log sum_v p_v^2 [B, L-1] (no grad): what WPO's weights (`dpo.use_weighting`) are
    made of, from the same forward; the second projection of each chunk runs without gradients."""
    states, head = completion_states(model, batch, positions)
    rows = positions.nonzero(as_tuple=True)
    if "unpack" in batch:
        targets = batch["input_ids"][0, batch["unpack"][:, 1:][rows]]
    else:
        targets = batch["input_ids"][:, 1:][rows]
    scored, _ = score_states(states, targets, head, chunk_elements=chunk_elements)
    step = max(1, chunk_elements // head.out_features)
    with torch.no_grad():
        chunks = list(states.detach().split(step))
        chunks += [states[:0]] * (head_calls_on_every_rank(len(chunks), head, states.device) - len(chunks))
        sums = [torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1) for z in (upcast(head(h)) for h in chunks)]
    logp = positions.new_zeros(positions.shape, dtype=scored.dtype).index_put(rows, scored)
    sum_sq = logp.new_zeros(positions.shape).index_put(rows, torch.cat(sums).to(logp.dtype) if sums else scored[:0])
    return logp, sum_sq


def head_calls_on_every_rank(calls: int, head: Any, device: torch.device) -> int:
    """How many chunks each rank projects through `head`: its own `calls`, or under ZeRO-3 (a
    partitioned lm_head, whose every call gathers the weight with the other ranks, and again in
    the chunk's recomputation in backward) the most any rank needs, the others padding with empty
    chunks. Ranks score different numbers of positions; unequal calls would pair one rank's
    gather with another's next collective (gloo: "Received data size doesn't match expected size").
    One all-reduce of an integer per call."""
    import torch.distributed as dist

    if not hasattr(getattr(head, "weight", None), "ds_id") or not dist.is_initialized() or dist.get_world_size() == 1:
        return calls
    most = torch.tensor([calls], dtype=torch.long, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def completion_states(model: Any, batch: dict[str, Tensor], positions: Tensor) -> tuple[Tensor, Any]:
    """The final hidden states [N, H] that score the tokens after `positions` (bool [B, L-1], in
    the order of `positions.nonzero()`; padded or padding-free batches alike), and the model's
    lm_head module: what a full-vocabulary loss projects chunk by chunk (`rlkit/distill/loss.py`).
    One forward, through `model` (gradients flow when enabled)."""
    hf = _hf_model(model)
    head = hf.get_output_embeddings()
    rows = positions.nonzero(as_tuple=True)
    if "unpack" in batch:
        hidden, last = _last_hidden(model, hf, {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]})
        states = hidden[0, batch["unpack"][:, :-1][rows]]
    else:
        hidden, last = _last_hidden(model, hf, batch)
        states = hidden[:, :-1][rows]
    if _HEAD_ONLY.get(hf) is None:
        _HEAD_ONLY[hf] = _same_logits(head(hidden[:, -1:]), last)
    if not _HEAD_ONLY[hf]:
        raise ValueError(f"{type(hf).__name__} changes its logits after the lm_head (soft-capping or a scale): a loss "
                         "that projects hidden states through the lm_head alone (full-vocabulary distillation, "
                         "DPO's use_weighting) cannot score it")
    return states, head


def _packed_logprobs(model: Any, batch: dict[str, Tensor], temperature: float, with_entropy: bool,
                     positions: Tensor | None, chunk_elements: int,
                     keep_bytes: int | None) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of a padding-free micro-batch (`GRPOBatch.packed_micro_batch`): the model
    runs on the packed row, and the results come back in the padded [b, l-1] layout."""
    unpack = batch["unpack"]
    if positions is None:
        positions = unpack[:, 1:] >= 0
    rows = positions.nonzero(as_tuple=True)
    source = unpack[:, :-1][rows]  # where, in the packed row, each wanted position is
    wanted = torch.zeros_like(batch["input_ids"][:, 1:], dtype=torch.bool)
    wanted[0, source] = True
    packed = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    logp, entropy = token_logprobs(model, packed, temperature, with_entropy, wanted, chunk_elements, keep_bytes)
    out = logp.new_zeros(positions.shape).index_put(rows, logp[0, source])
    if entropy is not None:
        entropy = entropy.new_zeros(positions.shape).index_put(rows, entropy[0, source])
    return out, entropy


def _hf_model(model: Any) -> Any:
    """The transformers model inside a DeepSpeed engine and / or a peft wrapper."""
    inner = model.module if hasattr(model, "module") else model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _model_inputs(hf: Any, batch: dict[str, Tensor]) -> dict[str, Any]:
    from rlkit.data.images import model_image_inputs

    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False}
    images = model_image_inputs(batch)
    for name, value in images.items():  # a vision-language model's pixels, in its dtype
        kwargs[name] = value.to(hf.dtype) if value.is_floating_point() else value
    if images and kwargs["attention_mask"] is not None:
        return kwargs  # the model places its own positions (Qwen2-VL's 3-D M-RoPE: not 0.. per row)
    if "position_ids" in batch:  # packed rows: positions restart per sequence
        kwargs["position_ids"] = batch["position_ids"]
        if kwargs["attention_mask"] is None:  # padding-free: where each sequence starts, for its attention
            kwargs.update(sequence_bounds(hf, batch["position_ids"]))
    return kwargs


def _last_hidden(model: Any, hf: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The final hidden states [B, L, H] (after the last norm, what the lm_head reads) and the
    logits of the last position [B, 1, V], from one forward through `model` (a DeepSpeed engine's
    forward: its backward hooks see the hidden states). Without gradients a hook on the decoder
    takes its output, so the layers' outputs are not all kept."""
    if torch.is_grad_enabled():
        out = model(**_model_inputs(hf, batch), output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1], out.logits
    taken: list[Tensor] = []
    hook = hf.get_decoder().register_forward_hook(
        lambda _m, _i, o: taken.append(o.last_hidden_state if hasattr(o, "last_hidden_state") else o[0]))
    try:
        out = model(**_model_inputs(hf, batch), logits_to_keep=1)
    finally:
        hook.remove()
    return taken[-1], out.logits


def _same_logits(head_logits: Tensor, model_logits: Tensor) -> bool:
    return bool(torch.allclose(head_logits.float(), model_logits.float(), rtol=1e-3, atol=1e-3))


def _full_logits_path(model: Any, hf: Any, batch: dict[str, Tensor], temperature: float, with_entropy: bool,
                      positions: Tensor) -> tuple[Tensor, Tensor | None]:
    """The model's own [B, L, V] logits (for models whose logits are not their lm_head's output;
    `hf` is its transformers model, `_hf_model(model)`)."""
    logits = upcast(model(**_model_inputs(hf, batch)).logits[:, :-1]) / temperature
    keep = positions.float()
    logp = selective_log_softmax(logits, batch["input_ids"][:, 1:]) * keep
    return logp, entropy_from_logits(logits.detach()) * keep if with_entropy else None


class Reference:
    """The frozen reference policy (the starting model) for KL terms.

    Full fine-tuning: a separate frozen copy of the starting model on this rank. LoRA/QLoRA:
    the policy itself with its adapters disabled (no second copy).
    """

    def __init__(self, policy: Any, finetuning: str, load_copy: Any):
        self.policy = policy
        self.copy = None
        self.moved = False  # the copy is no longer the starting model (TR-DPO): checkpoints keep it
        if finetuning == "full":
            self.copy = load_copy().eval()
            self.copy.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Tensor], temperature: float = 1.0, positions: Tensor | None = None) -> Tensor:
        """`token_logprobs` under the reference policy."""
        if self.copy is not None:
            return token_logprobs(self.copy, batch, temperature, positions=positions)[0]
        inner = self.policy.module if hasattr(self.policy, "module") else self.policy
        ctx = inner.disable_adapter() if hasattr(inner, "disable_adapter") else nullcontext()
        with ctx:
            return token_logprobs(self.policy, batch, temperature, positions=positions)[0]


def frozen_models(spec: Any, engine: Any, device: Any) -> tuple[Reference | None, Reference | None]:
    """The frozen models a learner (`LearnerSpec` `spec`, DeepSpeed `engine`, `DeviceInfo` `device`)
    scores with: the reference policy (full fine-tuning: a copy in the policy's dtype) and a
    distillation teacher (full weights on this rank, in its own dtype), each None when not asked for;
    each with its model's `kernels` (`rlkit.model.kernels`)."""
    from rlkit.model.kernels import with_kernels
    from rlkit.model.load import load_frozen, resolve_dtype

    def loader(model: Any, dtype: Any, key: str) -> Any:
        return lambda: with_kernels(load_frozen(model, dtype, engine.device), model.kernels, device.kind, key)

    reference = teacher = None
    if spec.reference:
        reference = Reference(engine.module, spec.finetuning,
                              loader(spec.model, engine.module.dtype if spec.finetuning == "full" else None,
                                     "model.kernels"))
    if spec.teacher is not None:
        teacher_dtype = resolve_dtype(spec.teacher.dtype, device.bf16 and device.is_accelerator)
        teacher = Reference(engine.module, "full", loader(spec.teacher, teacher_dtype, "distill.teacher.kernels"))
    return reference, teacher


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
