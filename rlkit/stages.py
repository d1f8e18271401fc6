"""The training stages and their recipe types; `load` reads a recipe for one of them.

`load(stage, path, overrides)` reads the YAML, applies `key.sub=value` overrides and checks
types and cross-field rules before any work starts; see `rlkit.recipe` for the error format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError
from rlkit.grpo.config import GRPOConfig
from rlkit.recipe import build, merge, parse_overrides, read_yaml
from rlkit.sft.config import SFTConfig

STAGES: dict[str, type] = {"sft": SFTConfig, "grpo": GRPOConfig}


def load(stage: str, path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a recipe for `stage`, apply overrides, return the frozen config. Raises ConfigError."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; expected one of {sorted(STAGES)}")
    data = read_yaml(path)
    declared = data.pop("stage", stage)
    if declared != stage:
        raise ConfigError(f"{path}: stage: this recipe is for {declared!r}, not {stage!r}")
    if overrides:
        data = merge(data, parse_overrides(overrides))
    return build(STAGES[stage], data, str(path))
