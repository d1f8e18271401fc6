"""`rlkit estimate RECIPE [--hardware 8xA100-80G] [key.sub=value ...]`: memory per process, before launch.

The command's face: it reads the recipe as its stage would (`stages.load`) and hands the model's
config to `rlkit.estimate`, which knows no stage and no command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlkit.estimate import Arch, Hardware, config_json, report


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="memory per process of a recipe, before launch (reads config.json only)",
                       description="memory per process of a recipe by part, a verdict per device of the hardware, "
                                   "and the changes that make it fit")
    p.add_argument("recipe", help="an sft or grpo recipe")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override recipe keys")
    p.add_argument("--hardware", default=None, help="e.g. 8xA100-80G, 2x8x910B-64G, 1xH100 (default: no verdict)")
    p.add_argument("--config", default=None, help="the model's config.json, folder or hub id, when model.path has "
                                                  "none here (a placeholder, a run not made yet)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from rlkit import stages  # torch and the stages' configs: not for `rlkit --help`
    from rlkit.model.gguf import resolve_models

    try:
        declared = (yaml.safe_load(Path(args.recipe).read_text(encoding="utf-8")) or {}).get("stage", "sft")
    except (OSError, yaml.YAMLError, AttributeError):
        declared = "sft"
    stage = stages.stage(declared).name if declared in stages.TABLE else "sft"
    cfg = resolve_models(stages.load(stage, args.recipe, list(args.overrides)))
    config, source = config_json(cfg.model.path, args.config)
    arch = Arch.from_config(config, cfg.model.path)
    hardware = Hardware.parse(args.hardware) if args.hardware else None
    for line in report(cfg, stages.memory(stage), arch, source, hardware):
        print(line)
    return 0
