"""The shipped recipes: each loads, round-trips through --print-config, and loads its *data*:
files shaped as the seed guides describe them (or the synthetic task), read through the same
code and recipe keys (format, dataset, template, curriculum) the stage uses before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlkit import stages
from tests.helpers import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _stage(path: Path) -> str:
    import yaml

    return yaml.safe_load(path.read_text())["stage"]


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path):
    cfg = stages.load(_stage(path), path)
    assert cfg.output_dir


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny-sft.yaml", "opt-6.7b-lora.yaml", "qwen32b-npu-zero3.yaml", "llama7b-zero3-offload.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_print_config_round_trips(path, tmp_path):
    """--print-config prints YAML that loads back into the same config."""
    stage = _stage(path)
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", stage, str(path), "--print-config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    again = tmp_path / "resolved.yaml"
    again.write_text(out.stdout)
    assert stages.load(stage, again) == stages.load(stage, path)

# Seed 001 (LLaMA-Factory section): dataset_info.json naming an alpaca file, columns renamed.
DATASET_INFO = {"custom_dataset": {"file_name": "custom_data.json", "formatting": "alpaca",
                                   "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}
ALPACA = [{"instruction": "请解释什么是深度学习", "input": "", "output": "深度学习是机器学习的一个分支..."},
          {"instruction": "如何优化神经网络的性能？", "input": "",
           "output": "优化神经网络性能可以从以下几个方面入手..."}]
# Seed 002: alpaca rows with the curriculum's `difficulty` field.
CURRICULUM = [{"instruction": q, "input": "", "output": a, "difficulty": d} for q, a, d in (
    ("简单的问题", "答案", "explain"), ("需要推理的问题", "推理过程和答案", "reasoning"),
    ("复杂的拓扑问题", "详细分析", "topology"))]
# Seed 003 (R1 distillation / GRPO): math prompts with a reference answer.
MATH = [{"prompt": "What is 12 * 7? Put the final answer in \\boxed{}.", "answer": "84"},
        {"prompt": [{"role": "user", "content": "Solve x + 3 = 5."}], "answer": 2}]


def _write(path: Path, rows: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rows, ensure_ascii=False) if path.suffix == ".json" else \
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8")
    return path


def _data_files(recipe: dict, tmp: Path, task_data: dict) -> dict[str, Path | None]:
    """Files in the shape the recipe's seed describes, at the recipe's own file names."""
    data = recipe["data"]
    name = Path(data["train"]).name
    if data.get("build_synthetic_if_missing") is not None:
        kind = {"sft": "sft", "dpo": "dpo", "rm": "dpo", "kto": "dpo"}.get(recipe["stage"], "grpo")  # on the pairs
        return {"train": task_data[f"{kind}_train"], "eval": task_data[f"{kind}_eval"]}
    if "/gsm8k/pairs" in data["train"]:  # the real task's DPO pairs: a right and a wrong sample of each prompt
        from rlkit.gsm8k import preference_pairs, write_task

        grpo = write_task(tmp / "gsm8k", n_sft=2, n_grpo=2, n_heldout=2, train=[0, 1], heldout=[80])["grpo_train"]
        rows = [json.loads(x) for x in grpo.read_text().splitlines()]
        samples = [{"row": i, "completion": f"... #### {r['answer'] if ok else -1}", "rewards": {"accuracy": ok}}
                   for i, r in enumerate(rows) for ok in (1.0, 0.0)]
        preference_pairs(grpo, _write(tmp / "samples.jsonl", samples), tmp / "pairs")  # template 0: the eval's
        return {key: tmp / "pairs" / Path(data[key]).name for key in ("train", "eval")}
    if "/gsm8k/" in data["train"]:  # the real task's recipes: its own files, from two templates
        from rlkit.gsm8k import write_task

        written = write_task(tmp / "gsm8k", n_sft=2, n_grpo=2, n_heldout=2, train=[0], heldout=[80])
        return {key: written[Path(data[key]).stem] for key in ("train", "eval")}
    if name == "dataset_info.json":
        _write(tmp / "custom_data.json", ALPACA)
        return {"train": _write(tmp / name, DATASET_INFO), "eval": None}
    if recipe["stage"] in ("grpo", "distill"):
        return {"train": _write(tmp / name, MATH), "eval": _write(tmp / Path(data["eval"]).name, MATH)}
    rows = CURRICULUM if recipe.get("curriculum", {}).get("enabled") else ALPACA
    return {"train": _write(tmp / name, rows), "eval": None}


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads_its_data(path, tmp_path, tiny_model, task_data):
    from rlkit.model.load import load_tokenizer

    recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    files = _data_files(recipe, tmp_path, task_data)
    overrides = [f"data.train={files['train']}", f"data.eval={files['eval'] or 'null'}",
                 "data.build_synthetic_if_missing=null",
                 f"model.path={tiny_model}", "model.tokenizer=null", "device=auto"]
    cfg = stages.load(recipe["stage"], path, overrides)
    tokenizer = load_tokenizer(cfg.model)
    if recipe["stage"] == "sft":
        from rlkit.sft.run import load_sft_data

        data = load_sft_data(cfg.data, tokenizer)
        assert data.train and all(s["input_ids"] and s["labels"] for s in data.train)
        difficulties = data.difficulties
    elif recipe["stage"] in ("dpo", "rm"):
        from rlkit.dpo.run import load_pair_data

        pairs = load_pair_data(cfg.data, tokenizer)
        assert pairs.train and pairs.eval and all(p["chosen_ids"] and p["rejected_ids"] for p in pairs.train)
        difficulties = pairs.difficulties
    elif recipe["stage"] == "kto":
        from rlkit.kto.run import load_unpaired_data

        rows = load_unpaired_data(cfg.data, tokenizer)
        assert rows.train and rows.eval and all(r["completion_ids"] for r in rows.train)
        assert {r["label"] for r in rows.train} == {True, False}
        difficulties = rows.difficulties
    else:
        from rlkit.grpo.task import load_task

        task = load_task(cfg.model, cfg.data, cfg.rewards, cfg.grpo.reward_default, str(path.parent))
        assert task.rows and all(isinstance(task.render(r), str) for r in task.rows + task.eval_rows)
        task.scorer.close()
        difficulties = task.difficulties
    from rlkit.run.driver import curriculum_sampler

    sampler = curriculum_sampler(cfg.curriculum, difficulties, 10, 4, cfg.seed, str(files["train"]))
    assert len(sampler.next_batch()) == 4
    if recipe.get("curriculum", {}).get("enabled") and any(difficulties):
        assert sampler.curriculum, "the seed's difficulty levels must drive the curriculum"


DOCS = ROOT / "docs"


def _docs_block(lang: str, first_line: str) -> str:
    """The docs' fenced `lang` block whose first line is `first_line` (on any page)."""
    text = "".join(page.read_text(encoding="utf-8") for page in sorted(DOCS.glob("*.md")))
    blocks = text.split(f"```{lang}\n")[1:]
    return next(b.split("```")[0] for b in blocks if b.startswith(first_line + "\n"))


def test_the_key_reference_page_is_generated_from_the_code():
    from rlkit.keys import BEGIN, END, reference

    text = (DOCS / "keys.md").read_text(encoding="utf-8")
    table = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert table == reference(stages.config_types()), \
        "docs/keys.md is stale: python scripts/key_reference.py --write"
    for cls in stages.config_types().values():  # every key says what it does
        from rlkit.keys import keys

        assert all(meaning for _, _, meaning in keys(cls).values())


GUIDE_RECIPES = [p for p in RECIPES if not p.name.startswith("tiny-")]


@pytest.mark.parametrize("path", GUIDE_RECIPES, ids=[p.name for p in GUIDE_RECIPES])
def test_guide_recipes_say_what_they_are_and_comment_every_key(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    header = [line for line in lines[:12] if line.startswith("#")]
    assert header and ("Seed 00" in header[0] or "Not from a seed guide" in " ".join(header)), header[:1]
    assert any("rlkit " in line for line in header), "the header shows the command line"
    bare = [line for line in lines if not line.startswith("#") and not line.rstrip().endswith(":")
            and "#" not in line and line.strip()]
    assert not bare, f"keys without a comment: {bare}"


def test_the_docs_reward_example_runs_on_chat_and_text_rows(tmp_path, monkeypatch, capsys):
    """The docs' reward (my_rewards.py, docs/rewards.md) on chat rows (TRL's message shapes) and on text rows."""
    import argparse

    from rlkit.commands import reward as reward_cli

    (tmp_path / "my_rewards.py").write_text(_docs_block("python", "# my_rewards.py"), encoding="utf-8")
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # other tests have their own my_rewards:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder rlkit adds to find this one goes again
    chat = [{"prompt": [{"role": "user", "content": "首都？"}], "completion": "北京", "answer": "北京"},
            {"prompt": [{"role": "user", "content": "1+1?"}], "completion": " 2 ", "answer": "2"}]
    text = [{"prompt": "1+1?", "completion": "2", "answer": "2"}, {"prompt": "2+2?", "completion": "5", "answer": "4"}]
    _write(tmp_path / "chat.jsonl", chat)
    _write(tmp_path / "text.jsonl", text)
    monkeypatch.chdir(tmp_path)
    for name, mean in (("chat.jsonl", "1.000"), ("text.jsonl", "0.500")):
        parser = argparse.ArgumentParser()
        reward_cli.add_parser(parser.add_subparsers())
        args = parser.parse_args(["reward", "test", "my_rewards:exact", "--data", name])
        assert args.func(args) == 0, capsys.readouterr().err
        row = next(line for line in capsys.readouterr().out.splitlines() if line.strip("│ ").startswith("exact"))
        assert mean in row, (name, row)
    sys.modules.pop("my_rewards", None)


@pytest.mark.slow
def test_the_docs_minimal_recipe_runs_on_the_tiny_model(tmp_path, tiny_model, task_data):
    recipe = tmp_path / "my-sft.yaml"
    recipe.write_text(_docs_block("yaml", "# my-sft.yaml"), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", str(recipe), f"model.path={tiny_model}",
                          f"data.train={task_data['sft_train']}", "train.max_steps=3", "logging.progress=none",
                          f"output_dir={tmp_path / 'run'}", "--verbose"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rlkit sft: 2000 training rows; 16 rows per step (micro_batch_size 4 x grad_accum 4 x 1 learner)" \
        in out.stderr
    # --verbose: the actors' output live on the console, as Ray streams it, instead of in logs/
    assert "(Learner pid=" in out.stdout + out.stderr and not (tmp_path / "run" / "logs" / "learner-0.log").exists()
    final = tmp_path / "run" / "final"
    assert (final / "adapter" / "adapter_config.json").exists() and (final / "model.safetensors").exists()
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3]
