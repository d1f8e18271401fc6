"""Tiny models and synthetic arithmetic data, built offline (no model or data hub).

`build_tiny_model(out_dir, size)` trains a byte-level BPE tokenizer on generated text and
random-initialises a `Qwen2ForCausalLM`; `write_task_data(out_dir, seed)` writes alpaca SFT
rows with a `difficulty` field (SFT, and GRPO prompts whose answer is `output`), train and held-out splits.

The task is built so that each stage has something to learn in minutes on two CPU cores. SFT
rows come from a "teacher" that writes the answer three ways (`12`, `答案是12`, `结果: 12`);
the model memorises the fact tables and picks up that mix of formats. GRPO's exact-answer
reward wants the bare number: what RL learns here is a behaviour shared by every prompt
(answer in the required form), so it carries over to held-out prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.data.curriculum import DEFAULT_LEVELS as LEVELS  # the seeds' three difficulty levels

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
# A tool-calling ChatML template in Qwen2.5's format (calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn), with the tools listed in one short line each: a
# tiny model's context is short. Tokenizers built with it end turns at <|im_end|> (their EOS)
# and carry a response_template, as tool-calling models on the hub do.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}Tools:{% for t in tools %} {{ t['function']['name'] }}("
    "{% for p in t['function']['parameters']['properties'] %}{{ p }}{% if not loop.last %}, {% endif %}{% endfor %})"
    "{% endfor %}<|im_end|>\n{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


def level_facts(level: str) -> list[tuple[str, str]]:
    """Every `(expression, answer)` of a level: small fact tables (245 facts in all) that the tiny
    model can memorise in a few CPU minutes. It memorises rather than computes, so GRPO's held-out
    prompts are facts the SFT data covers but GRPO never trains on."""
    if level == "explain":
        return [(f"{a}+{b}", str(a + b)) for a in range(10) for b in range(10)]
    if level == "reasoning":
        return [(f"{a}-{b}", str(a - b)) for a in range(10, 19) for b in range(1, 10) if a - b >= 1]
    if level == "topology":
        return [(f"{a}*{b}", str(a * b)) for a in range(2, 10) for b in range(2, 10)]
    raise ValueError(f"unknown difficulty level {level!r}; expected one of {LEVELS}")


def make_problem(rng: random.Random, level: str) -> tuple[str, str]:
    """One arithmetic problem `(expression, answer)` of `level`, drawn uniformly from its facts."""
    return rng.choice(level_facts(level))


# How the SFT teacher writes an answer, with its share: only the first is an exact answer.
ANSWER_STYLES = (("{}", 0.3), ("答案是{}", 0.35), ("结果: {}", 0.35))


def _alpaca_row(rng: random.Random, level: str, fact: tuple[str, str] | None = None,
                styled: bool = False) -> dict:
    expr, ans = fact or make_problem(rng, level)
    instruction = rng.choice(["计算", "Compute", "求值"])
    if styled:
        style = rng.choices([s for s, _ in ANSWER_STYLES], [w for _, w in ANSWER_STYLES])[0]
        ans = style.format(ans)
    return {"instruction": instruction, "input": f"{expr}=", "output": ans, "difficulty": level}


def _pair(rng: random.Random, row: dict) -> dict:
    """A preference pair of an alpaca row: the bare answer chosen over one the SFT teacher's other
    styles write (two in three) or a wrong number (one in three)."""
    answer = row["output"]
    if rng.random() < 2 / 3:
        rejected = rng.choice([s for s, _ in ANSWER_STYLES[1:]]).format(answer)
    else:
        rejected = str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
    return {"instruction": row["instruction"], "input": row["input"], "chosen": answer, "rejected": rejected,
            "difficulty": row["difficulty"]}


TASK_FILES = ("sft_train.jsonl", "sft_eval.jsonl", "grpo_train.jsonl", "grpo_eval.jsonl", "dpo_train.jsonl",
              "dpo_eval.jsonl", "dataset_info.json")  # `write_task_data`'s
# LLaMA-Factory's dataset_info.json of the task's files (what a LLaMA-Factory recipe names them by)
DATASET_INFO = {
    "tiny_sft": {"file_name": "sft_train.jsonl"},
    **{f"tiny_{name}": {"file_name": f"{name}.jsonl", "ranking": True, "columns": {
        "prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}
       for name in ("dpo_train", "dpo_eval")}}
HOME = "tiny"  # the folder the tiny recipes build into (runs/tiny/model, runs/tiny/data)
VLM = "vlm"  # build_tiny_if_missing's name of the tiny vision-language model (`rlkit/tiny_vlm.py`)
VLM_HOME = "tiny-vlm"  # where the tiny VLM recipes build it, and write the shape task (same file names)


def own_build_path(path: str | Path, kind: str) -> bool:
    """Whether `path` is where the tiny recipes themselves build (`kind` "model": a `tiny/model`
    folder; "data": one of `TASK_FILES` in a `tiny/data` folder): a recipe's build_*_if_missing acts
    there only, never on a path a user named for their own model or data (a copied recipe keeps
    the key)."""
    parts = Path(path).parts
    if kind == "model":
        return parts[-2:] in ((HOME, "model"), (VLM_HOME, "model"))
    return len(parts) >= 3 and parts[-3:-1] in ((HOME, "data"), (VLM_HOME, "data")) and parts[-1] in TASK_FILES


def ensure_task_data(data: Any, shapes: Any = None) -> None:
    """Write the synthetic task where a recipe's `data.build_synthetic_if_missing` asks for it and
    `data.train` is missing, and say so; only at the tiny recipes' own path (`own_build_path`):
    the arithmetic task under `tiny/`, the shape-colour task under `tiny-vlm/` (`shapes`, the
    VLM module's `write_shape_task`, which builds on this one)."""
    import logging

    from rlkit.errors import UserError

    if data.build_synthetic_if_missing is None or Path(data.train).exists():
        return
    if not own_build_path(data.train, "data"):  # a copied recipe: the user's own (missing) file
        raise UserError(f"data.train: {data.train} does not exist (data.build_synthetic_if_missing writes the "
                        "synthetic task only at the tiny recipes' own runs/tiny/data/): fix the path")
    folder = Path(data.train).parent
    if folder.parent.name == VLM_HOME:
        shapes(folder, seed=data.build_synthetic_if_missing)
    else:
        write_task_data(folder, seed=data.build_synthetic_if_missing)
    logging.getLogger("rlkit").warning("data.train %s was missing: wrote the synthetic %s task there "
                                       "(data.build_synthetic_if_missing)", data.train,
                                       "shape-colour" if folder.parent.name == VLM_HOME else "arithmetic")


def write_task_data(out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 64,
                    n_prompts: int = 256, held_out: float = 0.25) -> dict[str, Path]:
    """Write `sft_train.jsonl`, `sft_eval.jsonl`, `grpo_train.jsonl`, `grpo_eval.jsonl`, `dpo_train.jsonl`,
    `dpo_eval.jsonl`, and a LLaMA-Factory `dataset_info.json` naming the SFT rows and the pairs.

    SFT rows cover every fact (each once, the rest drawn at random), answers in the teacher's
    mixed styles. GRPO rows carry the bare answer. A `held_out` share of each level's facts is kept out of
    `grpo_train`: `grpo_eval` asks exactly those (one row per fact, up to `n_eval`), so GRPO is
    judged on prompts it never trained on; the DPO pairs (`_pair`) split the facts as GRPO's
    prompts do. Deterministic for `seed`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train_facts, eval_rows = {}, []
    for level in LEVELS:
        facts = level_facts(level)
        rng.shuffle(facts)
        cut = round(len(facts) * held_out)
        eval_rows += [_alpaca_row(rng, level, f) for f in facts[:cut]]
        train_facts[level] = facts[cut:]
    rng.shuffle(eval_rows)

    def rows(n: int, facts: dict[str, list[tuple[str, str]]] | None, styled: bool = False) -> list[dict]:
        levels = [LEVELS[i % len(LEVELS)] for i in range(n)]
        return [_alpaca_row(rng, lv, rng.choice(facts[lv]) if facts else None, styled) for lv in levels]

    every = [_alpaca_row(rng, lv, f, styled=True) for lv in LEVELS for f in level_facts(lv)]  # each fact once
    sft_train = every + rows(max(n_train - len(every), 0), None, styled=True)
    rng.shuffle(sft_train)
    files = {
        "sft_train": sft_train,
        "sft_eval": rows(n_eval, None, styled=True),
        # GRPO prompts use the same alpaca rows: prompt = the rendered template, answer = output.
        "grpo_train": rows(n_prompts, train_facts),
        "grpo_eval": eval_rows[:n_eval],
        # preference pairs (LLaMA-Factory's alpaca ranking form) on GRPO's split of the facts
        "dpo_train": [_pair(rng, r) for r in rows(n_prompts * 2, train_facts)],
        "dpo_eval": [_pair(rng, r) for r in eval_rows[:n_eval]],
    }
    paths = {}
    for name, data in files.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
        paths[name] = path
    paths["dataset_info"] = out / "dataset_info.json"
    paths["dataset_info"].write_text(json.dumps(DATASET_INFO, indent=1), encoding="utf-8")
    return paths


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        expr, ans = make_problem(rng, LEVELS[i % 3])
        lines.append(f"### 指令:\n计算\n\n### 输入:\n{expr}=\n\n### 回答:\n{ans}")
        lines.append(f"Compute {expr}= {ans}. 求值 {expr} 答案 {ans}")
        lines.append(ANSWER_STYLES[1 + i % 2][0].format(ans))
    lines += ["<think> first add the numbers </think> <answer> 19 </answer>", "instruction input output"]
    return lines


def _tool_corpus(seed: int, n: int = 400) -> list[str]:
    """Calculator-task transcripts rendered with `TOOL_CHAT_TEMPLATE` as `apply_chat_template`
    renders it (transformers' renderer, its `tojson` included; pairs of their own): the
    tool-calling tokenizer learns the template's words (`assistant`, `tool_call`, `arguments`) as
    a tool-calling model's has them, not letter by letter; a transcript is about 98 tokens, not 190."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from rlkit.tiny_tools import tool_rows

    rng = random.Random(f"{seed}-tokenizer")
    rows = tool_rows(rng, [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)])
    return [render_jinja_template([r["messages"]], tools=r["tools"], chat_template=TOOL_CHAT_TEMPLATE)[0][0]
            for r in rows]


# ---------------------------------------------------------------- tokenizer + model


def build_tokenizer(vocab_size: int, seed: int = 0, tools: bool = False):
    """A byte-level BPE `PreTrainedTokenizerFast` with eos/pad and a ChatML template (with
    `tools`: trained on the calculator task's transcripts too, `TOOL_CHAT_TEMPLATE`, EOS <|im_end|>
    and TRL's Qwen response template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed) + (_tool_corpus(seed) if tools else []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
        bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if tools:
        from trl.chat_template_utils import qwen3_template

        fast.chat_template, fast.eos_token, fast.response_template = TOOL_CHAT_TEMPLATE, "<|im_end|>", qwen3_template
    return fast


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, tools: bool = False) -> Path:
    """Write a random-init Qwen2ForCausalLM + tokenizer to `out_dir` (safetensors); `tools`: a
    tool-calling chat template (`build_tokenizer`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; expected one of {sorted(SIZES)}")
    s = SIZES[size]
    out = Path(out_dir)
    tokenizer = build_tokenizer(s.vocab, seed, tools)
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
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118 - safe_open has no __iter__
    return n
