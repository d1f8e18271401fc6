"""The launch line that says what vLLM samples with: the recipe's rollout keys, never a model's
generation_config.json defaults (named when present), and every token a completion ends at."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from rlkit import stages
from rlkit.grpo.run import sampling_line
from rlkit.model.load import stop_token_ids
from tests.helpers import GRPO_RECIPE


def test_the_recipe_wins_over_generation_config_and_says_so(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "eos_token_id": [tok.eos_token_id, im_start], "do_sample": True}))
    cfg = stages.load("grpo", GRPO_RECIPE, [f"model.path={model}", "rollout.temperature=1.0", "rollout.max_tokens=32"])
    line = sampling_line(cfg, tok)
    assert "rollout.temperature 1, top_p 1, max_tokens 32" in line
    assert "generation_config.json asks for temperature 0.6, top_p 0.9: not applied" in line
    assert stop_token_ids(model, tok) == [tok.eos_token_id, im_start]
    assert f"ends at {tok.eos_token} ({tok.eos_token_id}), <|im_start|> ({im_start})" in line
    (model / "generation_config.json").unlink()
    assert "asks for" not in sampling_line(cfg, tok)
