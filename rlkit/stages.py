"""The training stages as one table; `load` reads a recipe for one of them.

A stage is a row of `TABLE`: its command's help line, its recipe type and its driver (both
"module:name", imported when used, so `rlkit --help` loads neither torch nor Ray), the section
that holds its batch sizes, and the recipe keys a DeepSpeed JSON's batch sizes fill. The command
line (`cli.py`) and the estimate command read the table; a new stage is its own folder (config,
objective, driver, memory model), a row here and a test.

`load(stage, path, overrides)` reads the YAML, applies `key.sub=value` overrides and checks
types and cross-field rules before any work starts; see `rlkit.recipe` for the error format.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError
from rlkit.recipe import build, merge, nearest_keys, parse_overrides, read_yaml


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    config: str = ""  # "module:Class" of its recipe type
    run: str = ""  # "module:function" of its driver: run(cfg, recipe_path=...) -> the final model's folder
    batch: str = ""  # the section with micro_batch_size, grad_accum and num_learners
    # a DeepSpeed JSON's batch keys -> the recipe key that holds each (what is missing is checked after the build)
    ds_batch_keys: dict[str, str] = field(default_factory=dict)
    batch_sizes: str = ""  # what gives its global batch, as a JSON's train_batch_size mismatch names it
    notes: str | None = None  # "module:function": lines `--print-config` adds after the config
    memory: str = ""  # "module:name" of its memory model (`rlkit.estimate.memory.MemoryModel`)
    of: str | None = None  # another stage's recipe type, driver and memory model
    needs: str | None = None  # a section the alias's recipe must set (`load` says so in one line otherwise)
    why: str = ""  # what that section is for, in that line


TABLE: dict[str, Stage] = {s.name: s for s in (
    Stage("sft", "supervised fine-tuning (full / LoRA / QLoRA, curriculum) from a recipe",
          "rlkit.sft.config:SFTConfig", "rlkit.sft.run:run_sft", "train",
          {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
           "gradient_accumulation_steps": "train.grad_accum"}, "train.micro_batch_size, grad_accum, num_learners",
          memory="rlkit.sft.memory:MEMORY"),
    # GRPO derives its gradient accumulation from the rollout batch
    Stage("grpo", "GRPO: vLLM rollout actors + DeepSpeed learners from a recipe",
          "rlkit.grpo.config:GRPOConfig", "rlkit.grpo.run:run_grpo", "grpo",
          {"train_micro_batch_size_per_gpu": "grpo.micro_batch_size"},
          "grpo.micro_batch_size, num_learners and the rollout batch", notes="rlkit.grpo.dry_run:recipe_notes",
          memory="rlkit.grpo.memory:MEMORY"),
    Stage("dpo", "preference optimisation (TRL's DPO loss family) on chosen/rejected pairs from a recipe",
          "rlkit.dpo.config:DPOConfig", "rlkit.dpo.run:run_dpo", "train",
          {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
           "gradient_accumulation_steps": "train.grad_accum"}, "train.micro_batch_size, grad_accum, num_learners",
          memory="rlkit.dpo.memory:MEMORY"),
    Stage("rm", "a reward model (one score, TRL's Bradley-Terry loss) on chosen/rejected pairs from a recipe",
          "rlkit.rm.config:RMConfig", "rlkit.rm.run:run_rm", "train",
          {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
           "gradient_accumulation_steps": "train.grad_accum"}, "train.micro_batch_size, grad_accum, num_learners",
          memory="rlkit.rm.memory:MEMORY"),
    Stage("kto", "KTO (TRL's KTOTrainer) on completions labelled desirable or not, or on pairs, from a recipe",
          "rlkit.kto.config:KTOConfig", "rlkit.kto.run:run_kto", "train",
          {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
           "gradient_accumulation_steps": "train.grad_accum"}, "train.micro_batch_size, grad_accum, num_learners",
          memory="rlkit.kto.memory:MEMORY"),
    # rlkit distill: a GRPO recipe with a `distill:` section (a teacher)
    Stage("distill", "on-policy distillation: the student samples (vLLM), a frozen teacher scores its tokens",
          of="grpo", needs="distill", why="naming the teacher (distill.teacher.path); without one this is a GRPO "
          "recipe (rlkit grpo)"),
)}
ALIASES = {s.name: s.of for s in TABLE.values() if s.of}


def stage(name: str) -> Stage:
    """The row whose recipe type and driver `name` uses (an alias's target)."""
    if name not in TABLE:
        raise ConfigError(f"unknown stage {name!r}; expected one of {sorted(TABLE)}")
    return TABLE[ALIASES.get(name, name)]


def resolve(spec: str) -> Any:
    """The object a "module:name" of the table names."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def memory(name: str) -> Any:
    """Stage `name`'s memory model (`rlkit.estimate.memory.MemoryModel`), for `rlkit estimate`."""
    return resolve(stage(name).memory)


def config_types() -> dict[str, type]:
    """Each stage's recipe type (the aliases share theirs), by name."""
    return {s.name: resolve(s.config) for s in TABLE.values() if not s.of}


def load(name: str, path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a recipe for stage `name`, apply overrides, return the frozen config. Raises ConfigError."""
    from rlkit.learner.ds_config import check_batch_claims, fold_config_file
    from rlkit.llamafactory import is_llamafactory, translate

    row = stage(name)
    data = read_yaml(path)
    if is_llamafactory(data):
        data = translate(data, path)
    declared = data.pop("stage", name)
    if declared not in TABLE or stage(declared) is not row:
        raise ConfigError(f"{path}: stage: this recipe is for {declared!r}, not {name!r}")
    if overrides:
        data = merge(data, parse_overrides(overrides))
    data, claims = fold_config_file(data, row.ds_batch_keys, path)
    cfg = build(resolve(row.config), data, str(path))
    if claims:
        t = getattr(cfg, row.batch)
        check_batch_claims(claims, cfg.deepspeed.config, t.micro_batch_size, t.grad_accum, t.num_learners,
                           row.batch_sizes)
    needs = TABLE[name].needs
    if needs and getattr(cfg, needs) is None:
        raise ConfigError(f"{path}: {needs}: rlkit {name} needs a {needs} section {TABLE[name].why}")
    return cfg


def key_for(name: str, key: str) -> str:
    """The recipe key of stage `name` that a bare `key` (`max_steps`, `lr`) stands for."""
    near = nearest_keys(resolve(stage(name).config), key)
    return near[0] if len(near) == 1 else "KEY"
