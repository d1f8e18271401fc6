"""`rlkit merge ADAPTER [--base MODEL] --out DIR`: fold a LoRA adapter into its base model (by
default the one its adapter_config.json names)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model (HF directory out)")
    p.add_argument("adapter", help="peft adapter directory (adapter_config.json)")
    p.add_argument("--base", default=None,
                   help="base model directory (default: base_model_name_or_path in adapter_config.json)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rlkit.errors import UserError
    from rlkit.model.load import merge_adapter

    config = Path(args.adapter) / "adapter_config.json"
    if not config.exists():
        raise UserError(f"{args.adapter}: not a peft adapter directory (no adapter_config.json)")
    base, named = args.base, "--base"
    if base is None:
        try:
            base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (ValueError, AttributeError):
            raise UserError(f"{config}: not valid JSON; give the base model with --base") from None
        named = f"base_model_name_or_path in {config}"
        if not base:
            raise UserError(f"{config} names no base model (base_model_name_or_path): give it with --base")
    if not (Path(base) / "config.json").exists():
        raise UserError(f"{named}: {base} is not a model directory (no config.json)"
                        + ("; give the base model's folder with --base" if args.base is None else ""))
    out = merge_adapter(args.adapter, base, args.out, args.dtype)
    print(f"merged model written to {out}")
    return 0
