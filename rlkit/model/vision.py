"""Vision-language models: which Auto class loads one, its parts (language model, projector,
vision tower), what the recipe freezes, where LoRA goes, and its processor beside the weights.
Torch and transformers only; `models.py` loads and wraps with these."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlkit.config import ModelConfig


def text_config(config: Any) -> Any:
    """A transformers config's language model part: a vision-language model's text config, else the
    config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def auto_class(config: Any) -> Any:
    """The transformers Auto class that loads a model of `config`: image-text-to-text for a
    vision-language model (its causal-LM class does not take images), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


# module names of the part between a vision tower and the language model, across architectures
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector", "aligner")


def vision_parts(model: Any) -> dict[str, list[str]]:
    """A vision-language model's parameter names by part: `language` (the decoder, the embeddings
    and the lm_head), `projector` (under a `PROJECTORS` module) and `vision` (the rest: the vision
    tower). Empty `projector` and `vision` for a text-only model."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    language = {id(p) for m in (hf.get_decoder(), hf.get_output_embeddings(), hf.get_input_embeddings())
                if m is not None for p in m.parameters()}
    parts: dict[str, list[str]] = {"language": [], "projector": [], "vision": []}
    for name, p in model.named_parameters():
        part = "language" if id(p) in language else "projector" if any(
            k in PROJECTORS for k in name.split(".")) else "vision"
        parts[part].append(name)
    return parts


def freeze_vision(model: Any, cfg: ModelConfig) -> None:
    """Freeze a vision-language model's vision tower and projector as the recipe asks
    (`model.freeze_vision_tower`, `model.freeze_multi_modal_projector`)."""
    parts = vision_parts(model)
    params = dict(model.named_parameters())
    for part, freeze in (("vision", cfg.freeze_vision_tower), ("projector", cfg.freeze_multi_modal_projector)):
        for name in parts[part] if freeze else ():
            params[name].requires_grad_(False)


def vision_language_targets(model: Any, names: Sequence[str], cfg: ModelConfig) -> tuple[list[str], list[str] | None]:
    """(the full names of the linear layers that get adapters, the projector modules trained
    whole or None): `names` (or every linear layer, `all-linear`) in the language model, and in
    the vision tower when `model.freeze_vision_tower` is false; the lm_head never. peft matches a
    plain name anywhere, which would put adapters on the vision tower's layers of the same name."""
    parts = vision_parts(model)
    allowed = {"language"} | ({"vision"} if not cfg.freeze_vision_tower else set())
    owners = {n.rsplit(".", 1)[0] for part in allowed for n in parts[part]}
    head = model.get_output_embeddings()
    targets = [n for n, m in model.named_modules() if n in owners and m is not head and isinstance(m, torch.nn.Linear)
               and ("all-linear" in names or n.rsplit(".", 1)[-1] in names)]
    projectors = sorted({n.split("." + k + ".")[0] + "." + k for n in parts["projector"] for k in PROJECTORS
                         if "." + k + "." in n}) if not cfg.freeze_multi_modal_projector else None
    return targets, projectors or None


def save_processor(model_dir: str | Path, out_dir: str | Path) -> None:
    """Copy a vision-language model's processor (image processor, processor config, chat
    template) from `model_dir` to `out_dir`, so `out_dir` loads with `AutoProcessor` as its source
    did; nothing for a text-only model. The tokenizer is written separately (and stays)."""
    import shutil

    src = Path(model_dir)
    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"):
        if (src / name).exists():
            shutil.copyfile(src / name, Path(out_dir) / name)
    if (src / "preprocessor_config.json").exists() and (src / "chat_template.jinja").exists() \
            and not (Path(out_dir) / "chat_template.jinja").exists():
        shutil.copyfile(src / "chat_template.jinja", Path(out_dir) / "chat_template.jinja")
