"""What a recipe asks of its models, checked before launch: each path a model directory or a hub
model this host can fetch, a config transformers can read, the attention kernel and QLoRA's
package installed, LoRA's target modules in the model; the offline tiny model built where a
tiny recipe asks for it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlkit.config import ModelConfig
from rlkit.model.facts import model_facts
from rlkit.model.vision import auto_class

log = logging.getLogger("rlkit")


def ensure_tiny_model(cfg: ModelConfig) -> None:
    """Build the offline tiny model at `cfg.path` if the recipe asks for it and it is missing,
    and say so; only at the tiny recipes' own path (`tiny.own_build_path`): a recipe copied with
    the key and pointed at the user's own (mistyped) model folder gets `check_model_path`'s line."""
    if cfg.build_tiny_if_missing and not (Path(cfg.path) / "config.json").exists():
        from rlkit.tiny import VLM, build_tiny_model, own_build_path
        from rlkit.tiny_vlm import build_tiny_vlm

        if not own_build_path(cfg.path, "model"):
            return
        if cfg.build_tiny_if_missing == VLM:
            build_tiny_vlm(cfg.path)
        else:
            build_tiny_model(cfg.path, cfg.build_tiny_if_missing)
        log.warning("model.path %s was missing: built an untrained %r tiny model there "
                    "(model.build_tiny_if_missing)", cfg.path, cfg.build_tiny_if_missing)


def check_lora_targets(cfg: ModelConfig, targets: Sequence[str], config: Any = None,
                       key: str = "lora.target_modules") -> None:
    """Every module name LoRA targets must name a layer of the model: peft adapts the names it
    finds and passes over the others without a word. The model is built on the meta device from
    its config (`config`, read from `cfg.path` if not given; no weights); a name matches a module
    as peft's list does (the whole dotted name, or its end after a dot)."""
    from rlkit.errors import UserError

    if "all-linear" in targets:
        return
    config = config or model_facts(cfg).config
    with torch.device("meta"):
        model = auto_class(config).from_config(config, trust_remote_code=cfg.trust_remote_code)
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
        raise UserError(f"{key}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a module of "
                        f"{type(model).__name__} ({cfg.path}; its linear layers: {', '.join(layers)}): name those")


def check_model(cfg: Any) -> None:
    """Before launch, what a stage recipe `cfg` asks of its model: the path of every model it names
    (`cfg.models()`: the student, a distillation teacher) and the student's tokenizer, options and
    LoRA targets (GRPO's engines: `engine.serving`; a teacher's own: `distill.teacher`)."""
    for key, model in cfg.models().items():
        check_model_path(model.path, f"{key}.path")
    config = model_facts(cfg.model).config  # transformers can read it (one line if not)
    if cfg.model.tokenizer:
        check_model_path(cfg.model.tokenizer, "model.tokenizer")
    check_model_options(cfg.model, cfg.finetuning)
    if cfg.finetuning in ("lora", "qlora"):
        check_lora_targets(cfg.model, cfg.lora.target_modules, config)


# attention kernels that need a package of their own
ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_model_options(cfg: ModelConfig, finetuning: str) -> None:
    """Before launch: an attention kernel transformers knows and whose package is installed, and
    bitsandbytes for QLoRA (each a traceback inside every learner otherwise)."""
    import importlib.util

    from transformers import AttentionInterface

    from rlkit.errors import UserError

    impl = cfg.attn_implementation
    names = ["eager", *sorted(k for k in AttentionInterface._global_mapping if "|" not in k)]
    if impl is not None and impl not in names and "|" not in impl and "/" not in impl:  # "/": a hub kernel
        raise UserError(f"{impl!r} is not an attention kernel transformers has: use one of {', '.join(names)} (or "
                        "null for its default)", "model.attn_implementation")
    package = ATTENTION_PACKAGES.get(impl or "")
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"{impl} needs the {package} package, which is not installed here: install it, or use "
                        "sdpa", "model.attn_implementation")
    if finetuning == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("QLoRA's 4-bit weights need bitsandbytes, which is not installed here: pip install "
                        "bitsandbytes, or use finetuning: lora", "finetuning")


def check_model_path(path: str, key: str = "model.path") -> None:
    """Fail before launch when `path` is neither a local model directory nor a hub model this
    host can fetch: a hub id (`org/name`) is looked up once, with a short timeout, so a host
    without network says so in one line instead of retrying for a minute inside the loaders."""
    from rlkit.errors import UserError
    from rlkit.paths import is_hub_id

    p = Path(path)
    if (p / "config.json").exists() or (key == "model.tokenizer" and p.is_dir()):
        return
    if not is_hub_id(path):
        hint = " (run `rlkit sft recipes/tiny-sft.yaml` first)" if "tiny-sft" in path else ""
        raise UserError(f"{key}: {path} is not a model directory (no config.json){hint}")
    problem = hub_problem(path)
    if problem:
        raise UserError(f"{key}: {path} is not a local folder, and as a hub id: {problem}")


def hub_problem(repo_id: str, timeout_s: float = 10.0) -> str | None:
    """None when the hub model `repo_id` is in the local cache or the hub answers for it; else
    what is wrong and what to do, in one phrase (one request, no retries)."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    fetch = (f"download it where there is network (`hf download {repo_id} --local-dir DIR`) and set the "
             "path to DIR")
    if constants.HF_HUB_OFFLINE:
        return f"it is not in the local hub cache and HF_HUB_OFFLINE is set: {fetch}"
    try:
        model_info(repo_id, timeout=timeout_s)
    except GatedRepoError:
        return f"{constants.ENDPOINT} says it is gated: accept its terms on the hub and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        return f"{constants.ENDPOINT} has no model {repo_id} (or it is private: log in with `hf auth login`)"
    except Exception as e:  # noqa: BLE001 - any transport failure means the same to the user
        return f"{constants.ENDPOINT} cannot be reached ({type(e).__name__}: {str(e)[:120]}): {fetch}, or set " \
               "HF_ENDPOINT to a mirror"
    return None


# config fields of models whose logits are not the lm_head's alone, and the value that changes nothing
_AFTER_HEAD = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def check_head_only(config: Any, path: str, key: str, instead: str) -> None:
    """Before launch, where a loss projects hidden states through the lm_head alone (`key`): one line
    for a model whose config changes its logits after the lm_head (Gemma 2's soft-capping, Cohere's
    scale, Granite's scaling), saying what to set (`instead`). The learner also checks at its first call."""
    from rlkit.errors import ConfigError

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field, neutral in _AFTER_HEAD.items():
        value = getattr(text, field, neutral)
        if value not in (neutral, None, 0):
            raise ConfigError(f"{path} ({text.model_type}) changes its logits after the lm_head ({field} {value}): "
                              f"{key} projects hidden states through the lm_head alone, so rlkit cannot score it: "
                              f"{instead}", key)
