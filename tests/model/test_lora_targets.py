"""LoRA's `target_modules` must each name a layer of the model: peft adapts the names it finds and
passes over the others silently (the seed's OPT recipe named o_proj, which OPT calls out_proj), and
`rlkit estimate` counted the missing module's parameters. Checked at launch against the model
itself (meta device, no weights), by the estimate against its architecture, and for every shipped
recipe against its model's published config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlkit.config import ModelConfig
from rlkit.errors import UserError
from rlkit.model.checks import check_lora_targets
from tests.helpers import ROOT


def _config_dir(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_target_the_model_does_not_have_is_one_line_naming_its_layers(tmp_path, tiny_model):
    check_lora_targets(ModelConfig(path=str(tiny_model)), ("q_proj", "v_proj", "self_attn.o_proj"))
    check_lora_targets(ModelConfig(path=str(tiny_model)), ("all-linear",))
    opt = _config_dir(tmp_path, "opt", dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                            num_attention_heads=4, vocab_size=100, word_embed_proj_dim=64))
    with pytest.raises(UserError, match=r"^lora.target_modules: o_proj is not a module of OPTForCausalLM \(.*; its "
                                        r"linear layers: fc1, fc2, k_proj, lm_head, out_proj, q_proj, v_proj\): "
                                        r"name those$"):
        check_lora_targets(ModelConfig(path=str(opt)), ("q_proj", "v_proj", "k_proj", "o_proj"))
    check_lora_targets(ModelConfig(path=str(opt)), ("q_proj", "v_proj", "k_proj", "out_proj"))


def test_the_estimate_counts_no_module_the_model_lacks():
    from rlkit import estimate as est

    opt = est.Arch.from_config(*est.config_json("facebook/opt-6.7b"))
    wanted = ("q_proj", "v_proj", "k_proj", "out_proj")
    assert opt.lora_params(16, wanted) == opt.layers * 4 * 16 * (4096 + 4096)
    with pytest.raises(UserError, match=r"^lora.target_modules: o_proj not in .*its block's linear layers: q_proj, "
                                        r"k_proj, v_proj, out_proj, fc1, fc2\): name those$"):
        opt.lora_params(16, ("q_proj", "o_proj"))


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")
                                          if "target_modules" in p.read_text()))
def test_every_shipped_lora_recipe_names_its_models_layers(recipe, tmp_path):
    """Against the published config of each recipe's model (kept in rlkit for the estimate) or the
    tiny / real-task model it builds, on the meta device."""
    from rlkit.estimate.arch import config_json

    doc = yaml.safe_load((ROOT / "recipes" / recipe).read_text())
    targets = doc["lora"]["target_modules"]
    targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
    path = doc["model"]["path"]
    for other in (ROOT / "recipes").glob("*.yaml"):  # a run's output: the model its recipe started from
        first = yaml.safe_load(other.read_text())
        if f"{first.get('output_dir')}/final" == path:
            path = first["model"]["path"]
    if path.endswith(".gguf") or "gsm8k" in path:  # SmolLM2 (llama): its published shape, at a tiny size
        config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    else:
        config = {**config_json(path)[0], "num_hidden_layers": 2}
    check_lora_targets(ModelConfig(path=str(_config_dir(tmp_path, path, config))), targets)
