"""The shipped recipes: each loads, round-trips through --print-config, and loads its *data*:
files shaped as the seed guides describe them (or the synthetic task), read through the same
code and recipe keys (format, dataset, template, curriculum) the stage uses before launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlkit import stages

ROOT = Path(__file__).resolve().parent.parent
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
        kind = "sft" if recipe["stage"] == "sft" else "grpo"
        return {"train": task_data[f"{kind}_train"], "eval": task_data[f"{kind}_eval"]}
    if name == "dataset_info.json":
        _write(tmp / "custom_data.json", ALPACA)
        return {"train": _write(tmp / name, DATASET_INFO), "eval": None}
    if recipe["stage"] == "grpo":
        return {"train": _write(tmp / name, MATH), "eval": _write(tmp / Path(data["eval"]).name, MATH)}
    rows = CURRICULUM if recipe.get("curriculum", {}).get("enabled") else ALPACA
    return {"train": _write(tmp / name, rows), "eval": None}


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads_its_data(path, tmp_path, tiny_model, task_data):
    from rlkit.models import load_tokenizer

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
    else:
        from rlkit.grpo.task import load_task

        task = load_task(cfg.model, cfg.data, cfg.rewards, cfg.grpo.reward_default, str(path.parent))
        assert task.rows and all(isinstance(task.render(r), str) for r in task.rows + task.eval_rows)
        task.scorer.close()
        difficulties = task.difficulties
    from rlkit.driver import curriculum_sampler

    sampler = curriculum_sampler(cfg.curriculum, difficulties, 10, 4, cfg.seed, str(files["train"]))
    assert len(sampler.next_batch()) == 4
    if recipe.get("curriculum", {}).get("enabled") and any(difficulties):
        assert sampler.curriculum, "the seed's difficulty levels must drive the curriculum"
