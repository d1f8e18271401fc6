"""A model's config.json is read once before launch (`rlkit.model.facts`): the stage checks, the
driver's kernel check, the engines' check, the packing check and the estimate share one read, and a
rewritten config.json is read again."""

from __future__ import annotations

import json
import shutil

from rlkit import stages
from rlkit.accel import detect
from rlkit.distill.teacher import check_distill
from rlkit.grpo.memory import MEMORY
from rlkit.grpo.run import check_packing
from rlkit.model import facts
from rlkit.rollout.serving import check_engines
from rlkit.run.driver import prepare_inputs
from tests.helpers import GRPO_RECIPE, grpo_overrides


def test_a_grpo_runs_checks_read_its_model_once_and_a_rewritten_one_again(tiny_model, task_data, tmp_path,
                                                                          monkeypatch):
    from transformers import AutoConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    reads: list[str] = []
    real = AutoConfig.from_pretrained.__func__
    monkeypatch.setattr(AutoConfig, "from_pretrained",
                        classmethod(lambda cls, path, **kw: reads.append(str(path)) or real(cls, path, **kw)))
    opened = []
    monkeypatch.setattr(facts, "read_json", lambda path, *a: opened.append(str(path)) or json.loads(path.read_text()))
    cfg = stages.load("grpo", GRPO_RECIPE, grpo_overrides(model, task_data, tmp_path / "run",
                                                          "grpo.max_tokens_per_micro_batch=512"))
    checks = [check_packing, check_engines, check_distill]
    for _ in range(2):  # (a second run in the same process reads nothing again)
        prepare_inputs(cfg, detect("cpu"), MEMORY, checks=checks)
    assert reads == [str(model)]
    assert facts.config_file(str(model))["model_type"] == facts.model_facts(cfg.model).model_type
    assert opened == [str(model / "config.json")]
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}, indent=1))
    prepare_inputs(cfg, detect("cpu"), MEMORY, checks=checks)
    assert reads == [str(model)] * 2 and facts.model_facts(cfg.model).config.max_position_embeddings == 4096
