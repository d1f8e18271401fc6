"""Load a causal LM and its tokenizer; wrap it for full, LoRA or QLoRA training; merge adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlkit.config import LoraConfig, ModelConfig, QuantConfig
from rlkit.model.facts import model_facts
from rlkit.model.vision import (
    auto_class,
    freeze_vision,
    is_vision_language,
    save_processor,
    vision_language_targets,
)

log = logging.getLogger("rlkit")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name: str, bf16_ok: bool) -> torch.dtype:
    """`auto` -> bf16 where supported on an accelerator, fp32 on CPU (CPU bf16 is emulated, slow)."""
    if name == "auto":
        return torch.bfloat16 if bf16_ok else torch.float32
    return DTYPES[name]


# generation_config.json fields vLLM (and HF generate) read as sampling defaults
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_new_tokens")


def generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The model folder's generation_config.json ({} when it has none or it is unreadable)."""
    import json

    try:
        return json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def stop_token_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """The token ids a completion ends at in vLLM: the tokenizer's EOS and generation_config.json's
    `eos_token_id` (one id or a list)."""
    extra = generation_config(model_dir).get("eos_token_id")
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i in [extra] if isinstance(extra, int) else extra or []:
        if i not in ids:
            ids.append(i)
    return ids


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer (pad = eos where it has none); one without tokenizer files is one line."""
    from transformers import AutoTokenizer

    from rlkit.errors import UserError

    where, key = (cfg.tokenizer, "model.tokenizer") if cfg.tokenizer else (cfg.path, "model.path")
    fix = "set model.tokenizer to the folder (or hub id) of the model's tokenizer"
    try:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:  # no tokenizer files, or a tokenizer class transformers lacks
        raise UserError(f"{where} has no tokenizer transformers can load ({' '.join(str(e).split())[:200]}): {fix}",
                        key) from None
    if not tok("a b").input_ids:  # transformers builds an empty tokenizer from a folder with no vocabulary
        raise UserError(f"{where} has no tokenizer files (the tokenizer transformers makes of it encodes text as "
                        f"nothing): {fix}", key)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_image_inputs(cfg: ModelConfig, tokenizer: Any) -> Any:
    """For a vision-language model, its processor wrapped for the driver (`ImageInputs`), using
    `tokenizer` (the one `load_tokenizer` gave); None for a text-only model. A processor
    transformers cannot load here is one line."""
    import importlib.util

    from transformers import AutoProcessor

    from rlkit.data.images import ImageInputs
    from rlkit.errors import UserError

    if not model_facts(cfg).vision:
        return None
    where = cfg.tokenizer or cfg.path
    try:
        processor = AutoProcessor.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, ImportError, AttributeError) as e:  # AttributeError: a processor class half there
        reason = " ".join(str(e).split())[:240]
        if "torchvision" in reason.lower() or importlib.util.find_spec("torchvision") is None:
            raise UserError(f"{where}: its processor needs torchvision, which is not installed here: install the "
                            "torchvision build that matches this torch (a model with a PIL image processor, such as "
                            "Idefics3/SmolVLM, runs without it)", "model.path") from None
        raise UserError(f"{where} has no processor transformers can load ({reason}): a vision-language model "
                        "folder holds its processor (preprocessor_config.json)", "model.path") from None
    processor.tokenizer = tokenizer
    if not getattr(tokenizer, "chat_template", None) and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template  # the template that places the images
    return ImageInputs(processor)


def load_frozen(cfg: ModelConfig, dtype: torch.dtype | None, device: Any) -> Any:
    """A frozen copy of a model (a reference, a teacher) on `device`, whole on every rank (`whole`)."""
    return whole(lambda: load_model(cfg, dtype).to(device))


def whole(load: Callable[[], Any]) -> Any:
    """`load()` with transformers' ZeRO-3 hook off: under ZeRO-3 the policy is partitioned as it
    loads (the process-wide HfDeepSpeedConfig), but a frozen copy (reference, teacher) must be
    whole on each rank: nothing gathers its parameters."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        return load()
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


HEADS = ("lm", "score")  # what a learner's model ends in: the lm_head, or one score (a reward model)


def head_class(config: Any, head: str = "lm") -> Any:
    """The transformers Auto class of a model ending in `head`: `auto_class` for the lm_head, a
    sequence classifier (its `score` layer, one label) for a reward model."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if head == "score" else auto_class(config)


def load_model(cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None, head: str = "lm") -> Any:
    """The model (`auto_class`: causal LM, or image-text-to-text for a vision-language model; with
    `head="score"` a sequence classifier of one label, its pad id the tokenizer's) in `dtype`;
    4-bit bitsandbytes weights when `quant` is given."""
    from rlkit.model.attention import use_packed_attention

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if quant is not None:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type,
            bnb_4bit_use_double_quant=quant.double_quant, bnb_4bit_compute_dtype=DTYPES[quant.compute_dtype])
    if head == "score":
        kwargs["num_labels"] = 1
    model = head_class(model_facts(cfg).config, head).from_pretrained(cfg.path, **kwargs)
    if head == "score":  # it scores each row at its last token that is not padding
        model.config.pad_token_id = load_tokenizer(cfg).pad_token_id
    use_packed_attention(model)  # sdpa, but packed rows attend per sequence (attention.py)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def keep_4bit_weights_trainable(model: Any) -> int:
    """Stop bitsandbytes repacking 4-bit weights for AVX512-BF16 on CPU.

    On CPU, the first eval-mode no-grad forward of a `Linear4bit` repacks its weight in place
    for the AVX512-BF16 kernel, and any later training step fails ("a view of a leaf Variable
    ... in-place operation"). The per-layer flag `support_avx512bf16_for_cpu = False` keeps the
    trainable layout. Returns how many layers were set. A no-op off CPU or without 4-bit layers.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def wrap_for_training(model: Any, finetuning: str, lora: LoraConfig | None, cfg: ModelConfig | None = None,
                      head: str = "lm") -> Any:
    """Full: the model itself. LoRA/QLoRA: a peft model with only the adapters trainable (a reward
    model's score layer trained whole, peft's SEQ_CLS). A
    vision-language model's vision tower and projector are frozen as `cfg` asks; its adapters go
    on the language model's layers (and the vision tower's, when it trains), and a projector that
    trains is trained whole."""
    vlm = cfg is not None and is_vision_language(model.config)
    if finetuning == "full":
        if vlm:
            freeze_vision(model, cfg)
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    assert lora is not None  # the recipe checks this at load
    if finetuning == "qlora":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)))
        keep_4bit_weights_trainable(model)
    targets: Any = list(lora.target_modules)
    if targets == ["all-linear"]:  # peft's name for every linear layer but the output head: a string, not a list
        targets = "all-linear"
    whole_modules = None
    if vlm:
        targets, whole_modules = vision_language_targets(model, lora.target_modules, cfg)
    peft_cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=targets, modules_to_save=whole_modules,
                              task_type="SEQ_CLS" if head == "score" else "CAUSAL_LM")
    peft_model = get_peft_model(model, peft_cfg)
    if finetuning == "qlora":
        keep_4bit_weights_trainable(peft_model)
    return peft_model


def trainable_summary(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def merge_adapter(adapter_dir: str | Path, base: str | Path, out_dir: str | Path, dtype: str = "fp32",
                  head: str = "lm") -> Path:
    """Merge a peft LoRA adapter into its base model and save a plain HF model directory (`head`:
    a reward model's adapter onto the base as a one-label sequence classifier)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    loader = head_class(AutoConfig.from_pretrained(base), head)
    extra = {"num_labels": 1} if head == "score" else {}
    base_model = loader.from_pretrained(base, dtype=DTYPES.get(dtype, torch.float32), **extra)
    if head == "score":
        base_model.config.pad_token_id = AutoTokenizer.from_pretrained(base).pad_token_id
    merged = PeftModel.from_pretrained(base_model, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out, safe_serialization=True)
    tok_src = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").exists() else base
    AutoTokenizer.from_pretrained(tok_src).save_pretrained(out)
    save_processor(base, out)
    return out
