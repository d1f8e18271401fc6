"""The offline tiny model loads in transformers and generates; the synthetic task is deterministic."""

import json
from pathlib import Path

import pytest
import torch

from rlkit.tiny import LEVELS, SIZES, make_problem, write_task_data


def test_tiny_model_loads_and_generates(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM CPU attention
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.chat_template
    assert tok.convert_ids_to_tokens(tok("12+7=").input_ids) == ["1", "2", "+", "7", "="]
    ids = tok("### 指令:\n计算\n\n### 输入:\n12+7=\n\n### 回答:\n", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.input_ids.shape[1]
    assert (tiny_model / "model.safetensors").exists()


def test_sizes_have_vllm_compatible_heads_and_25m_is_25m(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlkit.tiny import build_tiny_model

    assert all(s.hidden // s.heads >= 32 for s in SIZES.values())
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", "25m"))
    assert sum(p.numel() for p in model.parameters()) >= 25_000_000


def test_task_data_is_deterministic_with_levels(tmp_path):
    a = write_task_data(tmp_path / "a", seed=3)
    b = write_task_data(tmp_path / "b", seed=3)
    c = write_task_data(tmp_path / "c", seed=4)
    assert a["sft_train"].read_text() == b["sft_train"].read_text() != c["sft_train"].read_text()
    rows = [json.loads(x) for x in a["sft_train"].read_text().splitlines()]
    assert {r["difficulty"] for r in rows} == set(LEVELS)
    assert all(set(r) == {"instruction", "input", "output", "difficulty"} for r in rows)
    read = lambda name: [json.loads(x) for x in a[name].read_text().splitlines()]  # noqa: E731
    held = {r["input"] for r in read("grpo_eval")}
    assert len(held) == len(read("grpo_eval")) > 40, "one held-out row per held-out fact"
    assert not held & {r["input"] for r in read("grpo_train")}, "GRPO must not train on held-out prompts"
    assert held <= {r["input"] for r in rows}, "the SFT data covers every fact"
    assert {r["output"][:2] for r in rows} >= {"答案", "结果"} and any(r["output"].isdigit() for r in rows)
    assert all(r["output"].lstrip("-").isdigit() for r in read("grpo_train") + read("grpo_eval"))


@pytest.mark.parametrize("level", LEVELS)
def test_problems_are_correct(level):
    import random

    rng = random.Random(0)
    for _ in range(50):
        expr, ans = make_problem(rng, level)
        assert eval(expr) == int(ans)  # noqa: S307 - our own arithmetic strings
    with pytest.raises(ValueError, match="unknown difficulty level"):
        make_problem(rng, "hard")
    assert torch.__version__


def test_tiny_model_and_task_are_built_only_when_asked_and_said(tmp_path, caplog, monkeypatch):
    """A recipe key whose name says so builds them, with a line saying what and where; without
    it a missing model path is a one-line error (no untrained model passes for the user's)."""
    import logging
    from types import SimpleNamespace

    from rlkit import stages
    from rlkit.accel import detect
    from rlkit.config import DataConfig, DeepSpeedConfig, ModelConfig, OptimConfig
    from rlkit.errors import UserError
    from rlkit.run.driver import prepare_inputs as prepare

    monkeypatch.setattr("rlkit.paths.with_absolute_paths", lambda cfg: cfg)  # a partial config: no recipe type

    def prepare_inputs(model: ModelConfig, data: DataConfig) -> None:
        partial = SimpleNamespace(model=model, data=data, finetuning="full", qlora=None, deepspeed=DeepSpeedConfig(),
                                  optim=OptimConfig(), models=lambda: {"model": model})
        prepare(partial, detect("cpu"), stages.memory("sft"))

    with pytest.raises(UserError, match=r"model.path: .*nope is not a model directory \(no config.json\)"):
        prepare_inputs(ModelConfig(path=str(tmp_path / "nope")), DataConfig(train=str(tmp_path / "t.jsonl")))
    assert not (tmp_path / "nope").exists()
    # a copied tiny recipe keeps the keys: pointed at the user's own (mistyped) model or data, it
    # builds nothing there and names the missing path
    mine = tmp_path / "my-models"
    with pytest.raises(UserError, match=r"^model.path: .*my-models/qwen-sft is not a model directory"):
        prepare_inputs(ModelConfig(path=str(mine / "qwen-sft"), build_tiny_if_missing="tiny"),
                       DataConfig(train=str(tmp_path / "t.jsonl")))
    (tmp_path / "data").mkdir()
    with pytest.raises(UserError, match=r"^data.train: .*data/sft_train.jsonl does not exist \(data.build_synthetic"):
        prepare_inputs(ModelConfig(path=str(tmp_path / "runs" / "tiny" / "model"), build_tiny_if_missing="tiny"),
                       DataConfig(train=str(tmp_path / "data" / "sft_train.jsonl"), build_synthetic_if_missing=0))
    assert not mine.exists() and not list((tmp_path / "data").iterdir())
    # at the tiny recipes' own paths they are built, and said
    model = ModelConfig(path=str(tmp_path / "runs" / "tiny" / "model"), build_tiny_if_missing="tiny")
    data = DataConfig(train=str(tmp_path / "runs" / "tiny" / "data" / "sft_train.jsonl"), build_synthetic_if_missing=0)
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        prepare_inputs(model, data)
    assert (Path(model.path) / "config.json").exists() and Path(data.train).exists()
    assert f"model.path {model.path} was missing: built an untrained 'tiny' tiny model there" in caplog.text
    assert "wrote the synthetic arithmetic task there (data.build_synthetic_if_missing)" in caplog.text


def test_calculator_steps_credits_each_step_of_the_procedure():
    """A third for each argument copied from the question (in order), a third for repeating the
    tool's result; a direct answer or a malformed call earns nothing here."""
    from rlkit.tiny_tools import calculator_steps

    prompt = [{"role": "user", "content": "87+85=?"}]

    def call(name, args, result, answer):
        return [{"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                     "function": {"name": name, "arguments": args}}]},
                {"role": "tool", "name": name, "content": result}, {"role": "assistant", "content": answer}]

    completions = [call("add", {"a": 87, "b": 85}, "172", "172"), call("add", {"a": 87, "b": 66}, "153", "153"),
                   call("add", {"a": 85, "b": 87}, "172", "170"), call("multiply", {"a": 87, "b": 85}, "7395", "7395"),
                   [{"role": "assistant", "content": "172"}]]
    scores = calculator_steps(completions, [prompt] * len(completions))
    assert scores == pytest.approx([1.0, 2 / 3, 0.0, 1 / 3, 0.0])
