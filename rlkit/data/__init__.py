"""Data layer: load/validate rows, render templates, tokenise/pack, curriculum sampling.

Pure Python (+ torch in ``collate``); no Ray, DeepSpeed or vLLM imports. The ``collate``
names are loaded on first use, so ``from rlkit.data import DataError`` does not import torch.
"""

from typing import Any

from rlkit.data.curriculum import DEFAULT_LEVELS, DEFAULT_PHASES, CurriculumSampler, validate_phases
from rlkit.data.formats import LoadedRows, load_prompts, load_rows
from rlkit.data.templates import TEMPLATES, render_alpaca, render_prompt, render_sft
from rlkit.errors import DataError

_COLLATE = ("IGNORE_INDEX", "encode_sft", "pack_bins", "pack_collate", "pad_collate", "truncate_lengths")

__all__ = [
    "DEFAULT_LEVELS", "DEFAULT_PHASES", "TEMPLATES", "CurriculumSampler", "DataError",
    "LoadedRows", "load_prompts", "load_rows", "render_alpaca", "render_prompt", "render_sft",
    "validate_phases", *_COLLATE,
]


def __getattr__(name: str) -> Any:
    if name in _COLLATE:
        from rlkit.data import collate

        return getattr(collate, name)
    raise AttributeError(f"module 'rlkit.data' has no attribute {name!r}")
