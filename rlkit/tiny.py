"""Tiny models and synthetic arithmetic data, built offline (no model or data hub).

`build_tiny_model(out_dir, size)` trains a byte-level BPE tokenizer on generated text and
random-initialises a `Qwen2ForCausalLM`; `write_task_data(out_dir, seed)` writes alpaca SFT
rows with a `difficulty` field (SFT, and GRPO prompts whose answer is `output`), train and held-out splits.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
LEVELS = ("explain", "reasoning", "topology")


@dataclass(frozen=True)
class TinySize:
    """Shape of a tiny Qwen2. vLLM's CPU attention needs head_dim >= 32."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = True


SIZES = {
    # ~0.2M params: the embedded default and the tests.
    "tiny": TinySize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512),
    # Same as tiny with an untied lm_head (weight-sync tests cover both).
    "tiny-untied": TinySize(128, 2, 4, 2, 256, 512, tie_embeddings=False),
    # ~26M params (the BPE corpus yields ~700 tokens of the 4096 asked): benchmarks.
    "25m": TinySize(hidden=512, layers=6, heads=8, kv_heads=4, intermediate=2304, vocab=4096),
}


# ---------------------------------------------------------------- synthetic task


def make_problem(rng: random.Random, level: str) -> tuple[str, str]:
    """One arithmetic problem `(expression, answer)`; harder levels use more/larger terms."""
    if level == "explain":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a}+{b}", str(a + b)
    if level == "reasoning":
        a, b = rng.randint(10, 99), rng.randint(1, 99)
        op = rng.choice("+-")
        return f"{a}{op}{b}", str(a + b if op == "+" else a - b)
    if level == "topology":
        a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 50)
        return f"{a}*{b}+{c}", str(a * b + c)
    raise ValueError(f"unknown difficulty level {level!r}; expected one of {LEVELS}")


def _alpaca_row(rng: random.Random, level: str) -> dict:
    expr, ans = make_problem(rng, level)
    instruction = rng.choice(["计算", "Compute", "求值"])
    return {"instruction": instruction, "input": f"{expr}=", "output": ans, "difficulty": level}




def write_task_data(out_dir: str | Path, seed: int = 0, n_train: int = 600, n_eval: int = 64,
                    n_prompts: int = 256) -> dict[str, Path]:
    """Write `sft_train.jsonl`, `sft_eval.jsonl`, `grpo_train.jsonl`, `grpo_eval.jsonl`.

    Deterministic for `seed`; held-out rows never repeat a training expression.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    seen: set[str] = set()

    def rows(n: int, make, exclude: set[str] | None) -> list[dict]:
        result = []
        while len(result) < n:
            row = make(rng, LEVELS[len(result) % len(LEVELS)])
            key = row["input"]
            if exclude is not None and key in exclude:
                continue
            seen.add(key)
            result.append(row)
        return result

    train = rows(n_train, _alpaca_row, None)
    train_keys = set(seen)
    sft_eval = rows(n_eval, _alpaca_row, train_keys)
    # GRPO prompts use the same alpaca rows: prompt = the rendered template, answer = output.
    grpo_train = rows(n_prompts, _alpaca_row, None)
    files = {
        "sft_train": train,
        "sft_eval": sft_eval,
        "grpo_train": grpo_train,
        # held out from SFT and from GRPO training
        "grpo_eval": rows(n_eval, _alpaca_row, train_keys | {r["input"] for r in grpo_train}),
    }
    paths = {}
    for name, data in files.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
        paths[name] = path
    return paths


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        expr, ans = make_problem(rng, LEVELS[i % 3])
        lines.append(f"### 指令:\n计算\n\n### 输入:\n{expr}=\n\n### 回答:\n{ans}")
        lines.append(f"Compute {expr}= {ans}. 求值 {expr} 答案 {ans}")
    lines += ["<think> first add the numbers </think> <answer> 19 </answer>", "instruction input output"]
    return lines


# ---------------------------------------------------------------- tokenizer + model


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE `PreTrainedTokenizerFast` with eos/pad and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
        bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-init Qwen2ForCausalLM + tokenizer to `out_dir` (safetensors)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; expected one of {sorted(SIZES)}")
    s = SIZES[size]
    out = Path(out_dir)
    tokenizer = build_tokenizer(s.vocab, seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=s.tie_embeddings,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def param_count(model_dir: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files (tied weights once)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n
