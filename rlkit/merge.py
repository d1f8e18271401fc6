"""`rlkit merge ADAPTER --base MODEL --out DIR`: fold a LoRA adapter into its base model."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model (HF directory out)")
    p.add_argument("adapter", help="peft adapter directory (adapter_config.json)")
    p.add_argument("--base", required=True, help="base model directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rlkit.errors import UserError
    from rlkit.models import merge_adapter

    if not (Path(args.adapter) / "adapter_config.json").exists():
        raise UserError(f"{args.adapter}: not a peft adapter directory (no adapter_config.json)")
    if not (Path(args.base) / "config.json").exists():
        raise UserError(f"--base {args.base}: not a model directory (no config.json)")
    out = merge_adapter(args.adapter, args.base, args.out, args.dtype)
    print(f"merged model written to {out}")
    return 0
