"""The training stages and their recipe types; `load` reads a recipe for one of them.

`load(stage, path, overrides)` reads the YAML, applies `key.sub=value` overrides and checks
types and cross-field rules before any work starts; see `rlkit.recipe` for the error format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.engine.ds_config import check_batch_claims, fold_config_file
from rlkit.errors import ConfigError
from rlkit.grpo.config import GRPOConfig
from rlkit.recipe import build, merge, nearest_keys, parse_overrides, read_yaml
from rlkit.sft.config import SFTConfig

STAGES: dict[str, type] = {"sft": SFTConfig, "grpo": GRPOConfig}
ALIASES = {"distill": "grpo"}  # rlkit distill: a GRPO recipe with a `distill:` section (a teacher)
# A DeepSpeed JSON's batch keys -> the recipe key that holds each, per stage (GRPO derives
# its gradient accumulation from the rollout batch: checked after the build instead).
DS_BATCH_KEYS = {"sft": {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
                         "gradient_accumulation_steps": "train.grad_accum"},
                 "grpo": {"train_micro_batch_size_per_gpu": "grpo.micro_batch_size"}}


def load(stage: str, path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a recipe for `stage`, apply overrides, return the frozen config. Raises ConfigError."""
    if ALIASES.get(stage, stage) not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; expected one of {sorted([*STAGES, *ALIASES])}")
    data = read_yaml(path)
    declared = data.pop("stage", stage)
    if ALIASES.get(declared, declared) != ALIASES.get(stage, stage):
        raise ConfigError(f"{path}: stage: this recipe is for {declared!r}, not {stage!r}")
    alias, stage = stage, ALIASES.get(stage, stage)
    if overrides:
        data = merge(data, parse_overrides(overrides))
    data, claims = fold_config_file(data, DS_BATCH_KEYS[stage], path)
    cfg = build(STAGES[stage], data, str(path))
    if claims:
        t = cfg.train if stage == "sft" else cfg.grpo
        keys = "train.micro_batch_size, grad_accum, num_learners" if stage == "sft" else \
            "grpo.micro_batch_size, num_learners and the rollout batch"
        check_batch_claims(claims, cfg.deepspeed.config, t.micro_batch_size, t.grad_accum, t.num_learners, keys)
    if alias == "distill" and cfg.distill is None:
        raise ConfigError(f"{path}: distill: rlkit distill needs a distill section naming the teacher "
                          "(distill.teacher.path); without one this is a GRPO recipe (rlkit grpo)")
    return cfg


def key_for(stage: str, name: str) -> str:
    """The recipe key of `stage` that a bare `name` (`max_steps`, `lr`) stands for."""
    near = nearest_keys(STAGES[ALIASES.get(stage, stage)], name)
    return near[0] if len(near) == 1 else "KEY"
