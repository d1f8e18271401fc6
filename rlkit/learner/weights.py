"""The learner's weights as the engines take them: `(hf_name, tensor)` in HF checkpoint naming.

`iter_named_weights(module, zero_stage, lora_merge)` yields them (ZeRO-3 gathered module by
module, LoRA merged). Every learner rank must iterate it (ZeRO-3 gathers are collective); only
rank 0 gets tensors (unless `all_ranks`) and hands them to a transport (`rlkit/sync/weight_sync.py`,
which groups them into the buckets an engine loads).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import nn

NamedTensor = tuple[str, torch.Tensor]
_PREFIXES = ("module.", "base_model.model.", "_orig_mod.")
_WRAPPERS = ("DeepSpeedEngine", "PipelineEngine", "DistributedDataParallel")


def hf_name(name: str) -> str:
    """Map a wrapped parameter name (DeepSpeed, peft, torch.compile) to its HF checkpoint name."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    if weight.__class__.__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(layer).detach()
    return weight.detach()


def _merged_lora(module: nn.Module) -> dict[str, torch.Tensor]:
    """`{"weight": W + sum_a scale_a * B_a @ A_a, "bias": ...}` for one peft LoRA layer,
    computed without touching the module."""
    base = module.get_base_layer()
    weight = _dense_weight(base).clone()
    bias = base.bias.detach().clone() if getattr(base, "bias", None) is not None else None
    if not module.disable_adapters and not module.merged:
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if getattr(module, "lora_variant", {}).get(adapter) is not None:
                raise NotImplementedError(
                    f"weight sync of LoRA variant (DoRA, ...) adapter {adapter!r} is not supported;"
                    " merge the adapter into the model or disable the variant")
            weight += module.get_delta_weight(adapter).to(weight.dtype)
            if getattr(module, "lora_bias", {}).get(adapter) and bias is not None:
                bias += module.lora_B[adapter].bias.detach() * module.scaling[adapter]
    out = {"weight": weight}
    if bias is not None:
        out["bias"] = bias
    return out


def _units(model: nn.Module, lora_merge: bool) -> Iterator[tuple[str, nn.Module, bool]]:
    """(name, module, is_lora_unit) in module order; a LoRA layer is one unit, children skipped."""
    skip: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if skip and name.startswith(skip):
            continue
        if lora_merge and _is_lora_layer(module):
            skip = skip + (name + ".",)
            yield name, module, True
        elif ".original_module" in f".{name}." or ".lora_" in f".{name}":
            continue
        else:
            yield name, module, False


def _gathered(params: list[nn.Parameter]):
    """Gather ZeRO-3 partitioned params for reading (all ranks must enter); else a no-op."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def iter_named_weights(module: nn.Module, zero_stage: int = 0, lora_merge: bool = False,
                       all_ranks: bool = False) -> Iterator[NamedTensor]:
    """Yield `(hf_name, tensor)` for every parameter of `module` in HF checkpoint naming.

    `module`: the model, a DeepSpeed engine (its `.module` is used) or a peft model.
    `zero_stage=3`: parameters are gathered one module at a time
    (`deepspeed.zero.GatheredParameters(params, modifier_rank=None)`); every rank must iterate,
    only rank 0 yields (cloned) tensors. Otherwise tensors are detached views of the live
    parameters, valid until the next optimizer step.
    `lora_merge`: for peft LoRA layers yield `W + scale * B @ A` under the base name and skip
    `lora_` parameters; the model is not modified.
    `all_ranks`: every rank yields (colocated engines, one per rank).
    """
    model = module
    while type(model).__name__ in _WRAPPERS:
        model = model.module
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() and not all_ranks else 0
    gather = zero_stage == 3
    seen: set[int] = set()
    for name, unit, is_lora in _units(model, lora_merge):
        params = list(unit.parameters() if is_lora else unit.parameters(recurse=False))
        if not params:
            continue
        with _gathered(params) if gather else nullcontext():
            if rank != 0:
                continue
            if is_lora:
                items = [(f"{name}.{k}", v) for k, v in _merged_lora(unit).items()]
            else:
                items = []
                for pname, p in unit.named_parameters(recurse=False):
                    if id(p) in seen or "lora_" in pname:
                        continue
                    seen.add(id(p))
                    items.append((f"{name}.{pname}" if name else pname,
                                  p.detach().clone() if gather else p.detach()))
            for full_name, tensor in items:
                yield hf_name(full_name), tensor
