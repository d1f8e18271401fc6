"""`rlkit dpo recipes/tiny-dpo.yaml` end to end on the tiny model: DPO from the SFT model on the
synthetic task's pairs (`rlkit/tiny.py`) learns what the pairs prefer on prompts it never saw."""

from __future__ import annotations

import json

import pytest

from rlkit import stages
from tests.helpers import ROOT, greedy_exact, pair_overrides, run_metrics


@pytest.mark.slow  # a 60-step run (~17 s) beside the SFT model it starts from
def test_dpo_from_the_sft_model_prefers_the_chosen_answers_it_never_saw(sft_model, task_data, tmp_path):
    """60 steps of TRL's sigmoid loss from the SFT model: on held-out pairs (facts the pairs never
    train on) the reward accuracy ends high and the loss falls from log 2; the greedy exact-answer
    rate on the held-out prompts rises (measured 0.08 -> 0.33); metrics carry TRL's names."""
    from rlkit.dpo.run import run_dpo

    cfg = stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", pair_overrides(sft_model, task_data, tmp_path / "dpo"))
    final = run_dpo(cfg)
    records = run_metrics(tmp_path / "dpo")
    evals = [r for r in records if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference
    assert evals[-1]["step"] == 60 and evals[-1]["eval/loss"] < 0.55
    assert evals[-1]["eval/rewards/accuracies"] >= 0.75 and evals[-1]["eval/rewards/margins"] > 0.3
    steps = [r for r in records if "train/loss" in r]
    assert {"train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracies", "train/rewards/margins",
            "train/logps/chosen", "train/logps/rejected", "time/reference"} <= set(steps[-1])
    rows = [json.loads(x) for x in task_data["grpo_eval"].read_text().splitlines()]
    before, after = greedy_exact(sft_model, rows), greedy_exact(final, rows)
    assert after >= before + 0.1, (before, after)


@pytest.mark.slow  # a 60-step run (~17 s)
def test_orpo_learns_the_pairs_without_a_reference(sft_model, task_data, tmp_path):
    """`dpo.loss_type: orpo` (TRL's experimental ORPO trainer's loss; SimPO and CPO take the same
    reference-free path): no reference is loaded or scored, the held-out preference accuracy (each
    side's mean logprob) rises from the SFT model's 0.31 to 0.9 or more (measured 0.98), and the
    greedy exact-answer rate on the held-out prompts rises with the chosen side's NLL in the loss
    (measured 0.08 -> 0.48)."""
    from rlkit.dpo.run import run_dpo

    loss_type = "orpo"
    out = tmp_path / loss_type
    final = run_dpo(stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml",
                                pair_overrides(sft_model, task_data, out, f"dpo.loss_type=[{loss_type}]")))
    records = run_metrics(out)
    evals = [r for r in records if "eval/loss" in r]
    assert evals[0]["eval/rewards/accuracies"] < 0.5 and evals[-1]["eval/rewards/accuracies"] >= 0.9, evals
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] and evals[-1]["eval/nll_loss"] < evals[0]["eval/nll_loss"]
    assert "no reference" in (out / "rlkit.log").read_text()  # the plan: no copy loaded, nothing scored
    assert max(r["time/reference"] for r in records if "train/loss" in r) < 0.01
    rows = [json.loads(x) for x in task_data["grpo_eval"].read_text().splitlines()]
    before, after = greedy_exact(sft_model, rows), greedy_exact(final, rows)
    assert after >= before + 0.2, (before, after)
