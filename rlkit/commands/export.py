"""`rlkit export CHECKPOINT --out DIR`: a HF model directory from any `checkpoints/step-N/`.

A checkpoint holds DeepSpeed's engine state (ZeRO shards, optimizer, scheduler) for resuming.
Export reads the weights back (ZeRO 1-3: the fp32 master weights, gathered over the ranks by
DeepSpeed's own `zero_to_fp32`; no ZeRO: the module's weights), puts them into the model the
checkpoint's `config.yaml` names, and writes what `final/` holds: a HF model with its tokenizer
(carrying the prompt template trained); for LoRA / QLoRA also `adapter/` (peft), merged onto the
full-precision base as `final/` is.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import yaml

from rlkit.errors import UserError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="a HF model directory from a checkpoint (checkpoints/step-N)")
    p.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/x/checkpoints/step-200")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights dtype (default fp32)")
    p.set_defaults(handler=run, quiet=True)  # DeepSpeed and transformers print at import and save


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype)
    print(f"exported {args.checkpoint} to {out}")
    return 0


def export_checkpoint(ckpt: Path, out: Path, dtype: str = "fp32") -> Path:
    """Write the model of checkpoint `ckpt` to `out` (written beside it, then renamed)."""
    from rlkit.data.templates import ship_template
    from rlkit.model.checks import check_model_path
    from rlkit.run.checkpoint import STATE_FILE, verify

    if not (ckpt / STATE_FILE).is_file():
        raise UserError(f"{ckpt}: not an rlkit checkpoint (no {STATE_FILE}); name a checkpoints/step-N folder")
    problem = verify(ckpt)
    if problem:
        raise UserError(f"{ckpt}: the checkpoint is damaged ({problem}); export another one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out: {out} exists and is not empty; choose a new folder")
    config = _config(ckpt)
    model, finetuning = config.get("model") or {}, config.get("finetuning", "full")
    base = model.get("path")
    check_model_path(str(base), "model.path (from the checkpoint's config.yaml)")
    state = _weights(ckpt, int((config.get("deepspeed") or {}).get("zero_stage", 0)), finetuning != "full")
    staging = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if finetuning == "full":
            _write_full(state, str(base), staging, dtype)
        else:
            _write_adapter(state, str(base), config.get("lora") or {}, staging, dtype)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model.get("tokenizer") or base).save_pretrained(staging)
        ship_template(staging, _template(ckpt, config))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _config(ckpt: Path) -> dict[str, Any]:
    """The config the checkpoint was trained with: its own config.yaml, else its run's."""
    for path in (ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if path.is_file():
            return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    raise UserError(f"{ckpt}: no config.yaml in it or in its run folder; export needs the run's model.path")


def _template(ckpt: Path, config: dict[str, Any]) -> str:
    """The prompt template the checkpoint was trained with (its state; else the recipe's, when named)."""
    import json

    from rlkit.run.checkpoint import STATE_FILE

    state = json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
    return state.get("template") or (config.get("data") or {}).get("template") or "alpaca"


def _weights(ckpt: Path, zero_stage: int, adapter_only: bool) -> dict[str, Any]:
    """The trained weights by parameter name (fp32 master weights under ZeRO)."""
    import torch

    if zero_stage == 0:
        return torch.load(ckpt / "engine" / "mp_rank_00_model_states.pt", map_location="cpu",
                          weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="engine",
                                                    exclude_frozen_parameters=adapter_only)


def _load(model: Any, state: dict[str, Any], ckpt_what: str, allowed_missing: set[str]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in allowed_missing]
    if unexpected or missing:
        raise UserError(f"the checkpoint's {ckpt_what} do not fit the model of model.path: "
                        f"{len(unexpected)} unexpected ({', '.join(unexpected[:2])}), {len(missing)} missing "
                        f"({', '.join(missing[:2])}); was model.path changed since the run?")


def _write_full(state: dict[str, Any], base: str, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.model.load import DTYPES

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict().items():
        groups.setdefault(tensor.data_ptr(), []).append(name)
    tied = {k for names in groups.values() if len(names) > 1 and any(n in state for n in names) for k in names}
    _load(model, state, "weights", tied)  # a tied weight (lm_head = embeddings) may be saved once
    model.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True)


def _write_adapter(state: dict[str, Any], base: str, lora: dict[str, Any], out: Path, dtype: str) -> None:
    """peft's adapter at `out/adapter`, merged onto the full-precision base at `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.config import LoraConfig
    from rlkit.model.load import merge_adapter, wrap_for_training

    cfg = LoraConfig(**{**lora, "target_modules": tuple(lora.get("target_modules") or LoraConfig.target_modules)})
    model = wrap_for_training(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), "lora", cfg)
    frozen = {k for k in model.state_dict() if "lora_" not in k}
    adapter = {k: v for k, v in state.items() if "lora_" in k}  # QLoRA also saved its 4-bit quant states
    _load(model, adapter, "adapter weights", frozen)
    model.save_pretrained(out / "adapter", safe_serialization=True)
    merge_adapter(out / "adapter", base, out, dtype)
