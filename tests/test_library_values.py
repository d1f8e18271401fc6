"""Recipe and data values a library would reject (vLLM, DeepSpeed, transformers, jinja, peft) are
caught before launch, each in one line naming the recipe key or the file and row, instead of the
library's traceback from inside a learner or an engine after launch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import stages
from rlkit.errors import ConfigError, DataError, UserError
from rlkit.run.driver import prepare_inputs
from tests.helpers import ROOT, grpo_overrides, sft_overrides

STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                   "supported') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _grpo(tiny_model, task_data, tmp_path, *extra):
    overrides = grpo_overrides(tiny_model, task_data, tmp_path / "o", *extra)
    return stages.load("grpo", ROOT / "recipes" / "tiny-grpo.yaml", overrides)


def _sft(tiny_model, task_data, tmp_path, *extra):
    return stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", sft_overrides(tiny_model, task_data, tmp_path / "o",
                                                                                *extra))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_longer_than_the_engines_context_is_one_line_naming_it(tiny_model, task_data, tmp_path, caplog):
    from rlkit.grpo.task import load_task

    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "9 " * 300, "answer": "9"}]
    cfg = _grpo(tiny_model, task_data, tmp_path, f"data.train={_jsonl(tmp_path / 'p.jsonl', rows)}",
                "rollout.max_model_len=128", "rollout.max_tokens=16")
    with pytest.raises(ConfigError, match=r"^rollout.max_model_len: .*p.jsonl: prompt 2 is \d+ tokens, the engines "
                                          r"hold 128 with its completion: raise it, or shorten or drop the row$"):
        load_task(cfg.model, cfg.data, cfg.rewards, None, None, rollout=cfg.rollout)
    rows[1]["prompt"] = "9 " * 55  # fits, but leaves less than max_tokens: counted in a warning
    _jsonl(tmp_path / "p.jsonl", rows)
    import logging

    with caplog.at_level(logging.WARNING, logger="rlkit"):
        load_task(cfg.model, cfg.data, cfg.rewards, None, None, rollout=cfg.rollout)
    assert "1 prompts leave less than rollout.max_tokens (16) of rollout.max_model_len (128)" in caplog.text


@pytest.fixture()
def strict_model(tiny_model, tmp_path) -> Path:
    """The tiny model with a chat template that refuses a system turn (as Gemma's does)."""
    model = tmp_path / "strict"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def test_a_row_the_chat_template_refuses_is_one_line_naming_it(strict_model, task_data, tmp_path):
    from rlkit.grpo.task import load_task
    from rlkit.sft.run import load_sft_data

    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1 ="}]
    rows = [{"prompt": [{"role": "user", "content": "2 + 2 ="}], "answer": "4"}, {"prompt": system, "answer": "2"}]
    cfg = _grpo(strict_model, task_data, tmp_path, f"data.train={_jsonl(tmp_path / 'g.jsonl', rows)}",
                "data.template=chat")
    with pytest.raises(DataError, match=r"^.*g.jsonl: prompt 2: the tokenizer's chat template refuses it \(System "
                                        r"role not supported\); fix the row, or set data.template: alpaca$"):
        load_task(cfg.model, cfg.data, cfg.rewards, None, None, rollout=cfg.rollout)

    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]},
             {"messages": [*system, {"role": "assistant", "content": "2"}]}]
    cfg = _sft(strict_model, task_data, tmp_path, f"data.train={_jsonl(tmp_path / 's.jsonl', chats)}",
               "data.eval=null", "eval.every=0", "data.template=chat")
    from rlkit.model.load import load_tokenizer

    with pytest.raises(DataError, match=r"s.jsonl: row 2: the tokenizer's chat template refuses it \(System role"):
        load_sft_data(cfg.data, load_tokenizer(cfg.model))


def test_deepspeed_extra_is_checked_against_deepspeed_before_launch(tiny_model, task_data, tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", str(ROOT / "recipes" / "tiny-sft.yaml"),
                          *sft_overrides(tiny_model, task_data, tmp_path / "o"), "deepspeed.zero_stage=2",
                          "deepspeed.extra.zero_optimization.reduce_bucket_sise=5e7"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (
        "rlkit: error: deepspeed.extra: DeepSpeed rejects zero_optimization.reduce_bucket_sise: Extra inputs are not "
        "permitted (its keys: https://www.deepspeed.ai/docs/config-json/)"), out.stderr[-2000:]
    assert not (tmp_path / "o" / "checkpoints").exists()
    cfg = _sft(tiny_model, task_data, tmp_path, "deepspeed.extra.gradient_accumulation_steps=4")
    with pytest.raises(UserError, match=r"^deepspeed.extra: gradient_accumulation_steps is set by rlkit from the "
                                        r"stage's gradient accumulation: set that instead$"):
        prepare_inputs(cfg, _cpu(), stages.memory("sft"))


def _cpu():
    from rlkit.accel import detect

    return detect("cpu")


def test_zero3_on_one_learner_is_said_before_launch(tiny_model, task_data, tmp_path, caplog):
    cfg = _sft(tiny_model, task_data, tmp_path, "deepspeed.zero_stage=3")
    with caplog.at_level("WARNING", logger="rlkit"):
        prepare_inputs(cfg, _cpu(), stages.memory("sft"), learners=2)
        assert not any("zero_stage: 3" in r.getMessage() for r in caplog.records)
        prepare_inputs(cfg, _cpu(), stages.memory("sft"), learners=1)
    said = [r.getMessage() for r in caplog.records if "zero_stage: 3" in r.getMessage()]
    assert len(said) == 1 and "with one learner partitions nothing" in said[0], said


def test_liger_asked_for_where_it_cannot_apply_is_one_line(tiny_model, task_data, tmp_path):
    cpu = _cpu()
    with pytest.raises(UserError, match=r"^model.kernels: liger runs Triton kernels on a GPU, and this run's "
                                        r"learners are on cpu: use auto \(Liger where it applies\) or none$"):
        prepare_inputs(_sft(tiny_model, task_data, tmp_path, "model.kernels=liger"), cpu, stages.memory("sft"))
    for kernels in ("auto", "none"):  # never an error: auto applies them only where it can
        prepare_inputs(_sft(tiny_model, task_data, tmp_path, f"model.kernels={kernels}"), cpu, stages.memory("sft"))


def test_model_options_a_learner_could_not_load_are_one_line(tiny_model, task_data, tmp_path):
    cfg = _sft(tiny_model, task_data, tmp_path, "model.attn_implementation=flash_attn2")
    with pytest.raises(UserError, match=r"^model.attn_implementation: 'flash_attn2' is not an attention kernel "
                                        r"transformers has: use one of eager, .*sdpa"):
        prepare_inputs(cfg, _cpu(), stages.memory("sft"))
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        cfg = _sft(tiny_model, task_data, tmp_path, "model.attn_implementation=flash_attention_2")
        with pytest.raises(UserError, match=r"^model.attn_implementation: flash_attention_2 needs the flash_attn "
                                            r"package, which is not installed here: install it, or use sdpa$"):
            prepare_inputs(cfg, _cpu(), stages.memory("sft"))
    with pytest.raises(ConfigError, match=r"lora.alpha: must be > 0 \(the adapter's scale is alpha / r\), got 0"):
        _sft(tiny_model, task_data, tmp_path, "finetuning=lora", "lora.alpha=0")


def test_engines_load_the_models_own_tokenizer_and_code(tiny_model):
    """vLLM got neither model.tokenizer nor model.trust_remote_code: an engine read another
    tokenizer than the learners, or refused a remote-code model the learners load."""
    from rlkit.config import ModelConfig
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.generation import worker_options

    options = worker_options(RolloutConfig(), ModelConfig(path=str(tiny_model), tokenizer="/tok",
                                                          trust_remote_code=True), _cpu(), seed=0)
    assert options["llm_kwargs"] == {"trust_remote_code": True, "tokenizer": "/tok"}
    options = worker_options(RolloutConfig(), ModelConfig(path=str(tiny_model)), _cpu(), seed=0)
    assert options["llm_kwargs"] == {"trust_remote_code": False}


def test_engine_values_vllm_would_refuse_are_one_line(tiny_model, task_data, tmp_path):
    from rlkit.rollout.serving import check_engines

    with pytest.raises(UserError, match=r"^rollout.max_model_len: 4096 tokens is past the model's context \(1024, "
                                        r"max_position_embeddings of .*\): lower it$"):
        prepare_inputs(_grpo(tiny_model, task_data, tmp_path, "rollout.max_model_len=4096"), _cpu(),
                       stages.memory("grpo"), checks=[check_engines])  # GRPO's stage check
    with pytest.raises(UserError, match=r"^rollout.tensor_parallel_size: 3 does not divide the model's 4 attention "
                                        r"heads: choose a divisor$"):
        prepare_inputs(_grpo(tiny_model, task_data, tmp_path, "rollout.tensor_parallel_size=3"), _cpu(),
                       stages.memory("grpo"), checks=[check_engines])
    for bad, says in (("rollout.gpu_memory_utilization=1.5", r"rollout.gpu_memory_utilization: must be in \(0, 1\]"),
                      ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib: must be > 0 GiB"),
                      ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size: must be >= 1")):
        with pytest.raises(ConfigError, match=says):
            _grpo(tiny_model, task_data, tmp_path, bad)


def test_recipe_values_torch_or_ray_would_refuse_and_an_unknown_architecture(tiny_model, task_data, tmp_path):
    for bad, says in (("optim.betas=[0.9,1.5]", r"optim.betas: AdamW's betas must be in \[0, 1\)"),
                      ("optim.eps=0", "optim.eps: must be > 0"), ("ray.cpus_per_actor=0", "ray.cpus_per_actor: must "
                                                                                           "be > 0")):
        with pytest.raises(ConfigError, match=says):
            _sft(tiny_model, task_data, tmp_path, bad)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    (odd / "config.json").write_text(json.dumps({**json.loads((odd / "config.json").read_text()),
                                                 "model_type": "rlkit_unknown_arch"}))
    with pytest.raises(UserError, match=r"^model.path: transformers cannot read .*odd's config \(.*rlkit_unknown_arch"
                                        r".*\): a newer transformers, or model.trust_remote_code: true"):
        prepare_inputs(_sft(odd, task_data, tmp_path), _cpu(), stages.memory("sft"))


def test_a_model_folder_without_a_tokenizer_and_unserved_adapter_targets_are_one_line(tiny_model, task_data,
                                                                                     tmp_path):
    from rlkit.model.load import load_tokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", bare / "config.json")
    cfg = _sft(bare, task_data, tmp_path)
    with pytest.raises(UserError, match=r"^model.path: .*bare has no tokenizer files \(the tokenizer transformers "
                                        r"makes of it encodes text as nothing\): set model.tokenizer to the folder"):
        load_tokenizer(cfg.model)
    with pytest.raises(ConfigError, match=r"lora.target_modules: vLLM serves adapters on the decoder's linear layers, "
                                          r"not lm_head: drop them, or use rollout.lora_sync: merged"):
        _grpo(tiny_model, task_data, tmp_path, "finetuning=lora", "lora.r=8", "lora.target_modules=[q_proj,lm_head]",
              "rollout.lora_sync=adapter")


def test_prompts_with_images_need_a_vision_language_model_and_single_turn_rollouts(tiny_model, task_data, tmp_path):
    """A text-only model cannot see a prompt's images, and the multi-turn loops send text: each is
    one line naming the row, before launch."""
    from PIL import Image

    from rlkit.errors import DataError
    from rlkit.grpo.task import load_task

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "colour?", "answer": "black", "image": "a.png"}]
    cfg = _grpo(tiny_model, task_data, tmp_path, f"data.train={_jsonl(tmp_path / 'p.jsonl', rows)}")
    with pytest.raises(DataError, match=r"p.jsonl: row 2 has images, and .* is a text-only model \(no vision tower\)"):
        load_task(cfg.model, cfg.data, cfg.rewards, None, None, rollout=cfg.rollout)
