"""Attention for padding-free rows, one sequence at a time (torch and transformers only).

A packed row holds several sequences one after another, its `position_ids` restarting at 0 for
each (SFT's `data.packing`, GRPO's `grpo.max_tokens_per_micro_batch`). transformers' sdpa path
finds the restarts and builds a [T, T] block-diagonal mask: every query is scored against all
T keys, the masked ones included. `packed_sdpa` runs transformers' own sdpa on each sequence of
the row instead (causal, no mask): attention costs sum(len_i^2) rather than T^2 and no mask is
built; every other batch (padded, or with a mask of its own) goes to transformers' sdpa
unchanged. Flash-attention implementations read the same sequence bounds natively.

Models load with it wherever transformers would use sdpa (`use_packed_attention`, through
transformers' attention registry); a model whose code does not take a registered attention
keeps sdpa and the mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlkit.model.vision import text_config

PACKED_SDPA = "rlkit_packed_sdpa"
_READS_BOUNDS = (PACKED_SDPA, "flash_attention_2", "flash_attention_3", "flash_attention_4")


def packed_sdpa(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                cu_seq_lens_q: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, heads, T, D], key / value [B, kv_heads,
    T, D] -> ([B, T, heads, D], None). With `cu_seq_lens_q` (int [n + 1], the sequences' bounds in
    a row of B = 1) each sequence attends causally within itself; a sliding-window layer takes the
    mask transformers built for it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or kwargs.get("sliding_window") is not None:  # a window lives in the mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(name, None)
    bounds = cu_seq_lens_q.tolist()
    parts = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                    is_causal=True, **kwargs)[0] for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=1), None


def use_packed_attention(model: Any) -> bool:
    """Switch a transformers model that runs sdpa to `packed_sdpa` (registered once per process with
    sdpa's mask builder, so padded batches get exactly sdpa's mask and kernel). Returns whether the
    model runs it; other implementations (eager, flash-attention) are left as they are."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa)
        AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    try:
        model.set_attn_implementation(PACKED_SDPA)
    except (ValueError, NotImplementedError):  # a model class without the attention interface
        return False
    return True


def sequence_bounds(model: Any, position_ids: Tensor) -> dict[str, Any]:
    """The keyword arguments that tell `model`'s attention where the sequences of a packed row
    (`position_ids` [1, T], restarting at 0) begin and end, in transformers' flash-attention names;
    none when its attention does not read them (it finds them from `position_ids` itself)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in _READS_BOUNDS:
        return {}
    starts = (position_ids[0] == 0).nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    if implementation == PACKED_SDPA:  # every layer reads them as ints: on the host, not a device sync per layer
        bounds = bounds.cpu()
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


# transformers' layer types that carry a state from one position to the next (Gated DeltaNet,
# Mamba, short convolutions, attention beside a state); "mamba" is their older name
STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")


def carried_state(config: Any) -> str | None:
    """What in a model (its transformers `config`) carries a state from token to token, in words
    (`linear_attention layers`), or None for a model of attention layers only. A packed row would
    hand that state from one sequence to the next: transformers passes the sequences' bounds to its
    attention, and its reference kernels for these layers (what runs without fla/causal-conv1d
    kernels, the CPU always) ignore them. From the config's `layer_types`, else transformers' own
    `_is_stateful` mark on the model class (Mamba, Jamba, Falcon-H1, Zamba, RWKV, ...)."""
    text = text_config(config)
    kinds = sorted({kind for kind in getattr(text, "layer_types", None) or () if kind in STATE_LAYER_TYPES})
    if kinds:
        return f"{' and '.join(kinds)} layers"
    return f"{config.model_type}'s recurrent layers" if _stateful_class(config) else None


def _stateful_class(config: Any) -> bool:
    """transformers' `_is_stateful` on the model class `config` names (its `architectures`, else
    the causal-LM class of its model type); False for a class transformers does not ship."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = [*(getattr(config, "architectures", None) or ()),
             MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), "")]
    for name in filter(None, names):
        try:
            cls = getattr(transformers, name)
        except (AttributeError, ImportError, RuntimeError):  # not shipped, or a missing optional dependency
            continue
        return bool(getattr(cls, "_is_stateful", False))
    return False


def check_packable(config: Any, path: str, key: str, instead: str) -> None:
    """Before launch, where a recipe packs sequences into one row (`key`): one line for a model
    whose layers carry a state from token to token (`carried_state`), saying what to set
    (`instead`) to keep its sequences in rows of their own."""
    from rlkit.errors import ConfigError

    state = carried_state(config)
    if state:
        raise ConfigError(f"{path} ({config.model_type}) has {state}, which carry a state from token to token: a "
                          "packed row would hand one sequence's state to the next (transformers' kernels for them "
                          f"do not read the sequence bounds), so rlkit does not pack it: {instead}", key)
