"""What rlkit knows of a model before launch, read once: its config.json as written (`config_file`,
what the estimate reads) and as transformers reads it (`model_facts`: the config, its model type,
whether it is a vision-language model, which of its layers carry a state). The stage checks, the
driver's kernel check, the engines' check, the packing checks, a distillation teacher's check and
the estimate all take a model's facts from here, so a run reads each config.json once (a read is
kept while the file is unchanged: its size and modification time)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.config import ModelConfig
from rlkit.errors import UserError, read_json


@dataclass(frozen=True)
class ModelFacts:
    """One model's facts, from its config as transformers reads it."""

    path: str
    config: Any  # transformers' config (a `PretrainedConfig`)

    @property
    def model_type(self) -> str:
        return getattr(self.config, "model_type", "") or ""

    @property
    def vision(self) -> bool:
        """A vision-language model (`model.vision.is_vision_language`)."""
        from rlkit.model.vision import is_vision_language

        return is_vision_language(self.config)

    @property
    def stateful(self) -> str | None:
        """The kind of its layers that carry a state from token to token, if any (`model.attention`)."""
        from rlkit.model.attention import carried_state

        return carried_state(self.config)


def model_facts(cfg: ModelConfig) -> ModelFacts:
    """The facts of the model `cfg` names; a model whose code transformers lacks is one line."""
    return _facts(cfg.path, cfg.trust_remote_code, _stamp(cfg.path))


def config_file(path: str) -> dict[str, Any] | None:
    """A local model folder's config.json as written (None: the folder has none)."""
    stamp = _stamp(path)
    return None if stamp is None else copy.deepcopy(_json(str(Path(path) / "config.json"), stamp))


def _stamp(path: str) -> tuple[int, int] | None:
    """What tells one config.json from a rewritten one: its size and modification time."""
    try:
        st = (Path(path) / "config.json").stat()
    except OSError:  # a hub id, or no model yet
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _json(file: str, stamp: tuple[int, int]) -> dict[str, Any]:
    return read_json(Path(file), dict, "a model's config.json (a JSON object)")


@functools.lru_cache(maxsize=32)
def _facts(path: str, trust_remote_code: bool, stamp: tuple[int, int] | None) -> ModelFacts:
    from transformers import AutoConfig

    try:
        return ModelFacts(path, AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    except ValueError as e:  # an architecture transformers does not know, or remote code not allowed
        first = " ".join(str(e).split())[:240]
        raise UserError(f"transformers cannot read {path}'s config ({first}): a newer transformers, or "
                        "model.trust_remote_code: true for a model that ships its own code", "model.path") from None
