"""`rlkit dpo`'s checks before launch and its batches: TRL's truncation; bad recipes and rows are
one line (the run itself: tests/e2e/test_dpo.py)."""

from __future__ import annotations

import json

import pytest
import torch

from rlkit import stages
from rlkit.errors import ConfigError, DataError
from tests.helpers import ROOT


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_a_side_over_the_cutoff_is_cut_as_trls_collator_cuts_it(mode):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from rlkit.dpo.objective import preference_batch
    from rlkit.dpo.run import truncate_pair

    pairs = [{"prompt_ids": [5, 6, 7, 8], "chosen_ids": [9, 10, 11, 12, 13], "rejected_ids": [14, 15]},
             {"prompt_ids": [5, 6], "chosen_ids": [9], "rejected_ids": [14, 15, 16, 17, 18, 19, 20]}]
    want = DataCollatorForPreference(pad_token_id=0, max_length=6, truncation_mode=mode)(pairs)
    got = preference_batch([truncate_pair(p, 6, mode) for p in pairs], 0)
    for key in got:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("override, message", [
    ("dpo.loss_type=[sigmoid,kto]", "dpo.loss_type: unknown 'kto'"),
    ("dpo.loss_type=[exo_pair]", "dpo.label_smoothing: exo_pair needs label_smoothing > 0"),
    ("dpo.f_divergence_type=js_divergence dpo.loss_type=[nca_pair]", "dpo.f_divergence_type: js_divergence "
     "generalises only"),
    ("dpo.loss_weights=[1.0,0.5]", "dpo.loss_weights: one weight per loss_type"),
    ("data.packing=true", "data.packing"),
    ("dpo.loss_type=[orpo,sft]", "dpo.loss_type: orpo needs no reference and is not combined with other losses"),
    ("dpo.cpo_alpha=-1", "dpo.cpo_alpha: must be >= 0"),
    ("finetuning=lora lora.r=4 lora.alpha=8 lora.target_modules=[q_proj] dpo.sync_ref_model=true",
     "dpo.sync_ref_model: with lora the reference is the policy with its adapters disabled"),
    ("dpo.sync_ref_model=true dpo.precompute_ref_log_probs=true", "dpo.sync_ref_model: a reference that moves"),
    ("dpo.loss_type=[simpo] dpo.precompute_ref_log_probs=true", "dpo.precompute_ref_log_probs: simpo is not "
     "a DPO loss on a reference"),
    ("dpo.loss_type=[aot] dpo.use_weighting=true", "dpo.use_weighting: aot sorts the pairs' ratios"),
    ("dpo.ref_model_mixup_alpha=0", "dpo.ref_model_mixup_alpha: must be in (0, 1]"),
    ("finetuning=lora lora.r=4 lora.alpha=8 lora.target_modules=[all-linear,q_proj]",
     "lora.target_modules: all-linear (every linear layer) stands alone"),
])
def test_a_bad_dpo_recipe_is_one_line_before_launch(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", override.split())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_that_leaves_no_room_for_a_response_is_one_line(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from rlkit.dpo.config import PreferenceDataConfig
    from rlkit.dpo.run import load_pair_data

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
            {"prompt": "1+1= " * 40, "chosen": "2", "rejected": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_pair_data(PreferenceDataConfig(train=str(path), cutoff_len=32, template="alpaca"),
                       AutoTokenizer.from_pretrained(tiny_model))
    assert str(e.value).startswith(f"{path}: row 2: its prompt is ") and "data.cutoff_len 32" in str(e.value)


@pytest.mark.parametrize("override, copy", [((), True), (("dpo.precompute_ref_log_probs=true",), False),
                                            (("dpo.loss_type=[orpo]",), False)])
def test_the_estimate_counts_the_reference_copy_only_where_the_learners_hold_one(override, copy):
    """Full fine-tuning holds a frozen reference copy, unless the reference is scored once before
    training (by the starting policy) or the loss needs none."""
    from rlkit import estimate as est

    cfg = stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", ["model.path=facebook/opt-6.7b", *override])
    (learner,) = est.estimate(cfg, stages.memory("dpo"), est.Arch.from_config(*est.config_json("facebook/opt-6.7b")))
    assert ("reference copy" in learner.parts) is copy


@pytest.mark.parametrize("kind, extra, refused", [
    ("gemma2", {}, "final_logit_softcapping 30.0"), ("cohere", {}, "logit_scale 0.0625"),
    ("granite", {"logits_scaling": 8.0}, "logits_scaling 8.0"), ("llama", {}, None),
    ("gemma3", {}, None),  # Gemma 3 dropped soft-capping: its text config's field is None
])
def test_wpo_on_a_model_that_changes_its_logits_after_the_lm_head_is_one_line_before_launch(tmp_path, kind, extra,
                                                                                             refused):
    """`dpo.use_weighting` projects hidden states through the lm_head alone: a soft-capped or scaled
    model is refused before launch (the learner's own check would only fail at the first step)."""
    from transformers import AutoConfig

    from rlkit.dpo.run import _check_model

    AutoConfig.for_model(kind, **extra).save_pretrained(tmp_path)
    cfg = stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", [f"model.path={tmp_path}", "dpo.use_weighting=true"])
    if refused is None:
        _check_model(cfg, None)
        return
    with pytest.raises(ConfigError) as e:
        _check_model(cfg, None)
    assert str(e.value).startswith(f"dpo.use_weighting: {tmp_path} ({kind}) changes its logits after the lm_head "
                                   f"({refused})") and "set dpo.use_weighting: false" in str(e.value)
