"""`rlkit kto recipes/tiny-kto.yaml` end to end on the tiny model: KTO from the SFT model on the
unpaired view of the DPO recipe's pairs learns what the pairs prefer on prompts it never saw."""

from __future__ import annotations

import json

import pytest

from rlkit import stages
from tests.helpers import ROOT, greedy_exact, pair_overrides, run_metrics


@pytest.mark.slow  # a 60-step run (~20 s) beside the SFT model it starts from
def test_kto_on_the_unpaired_pairs_separates_desirable_from_undesirable_on_held_out_rows(sft_model, task_data,
                                                                                          tmp_path):
    """60 steps of TRL's KTO loss (the KL estimate from mismatched completions) from the SFT model:
    on the held-out rows the loss falls from 0.5 (policy == reference), the desirable rows' mean
    reward ends above the undesirable rows' (margin measured 0 -> 0.94), and the greedy exact-answer
    rate on the held-out prompts rises (measured 0.08 -> 0.21)."""
    from rlkit.kto.run import run_kto

    out = tmp_path / "kto"
    final = run_kto(stages.load("kto", ROOT / "recipes" / "tiny-kto.yaml", pair_overrides(sft_model, task_data, out)))
    records = run_metrics(out)
    evals = [r for r in records if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/loss"] == pytest.approx(0.5, abs=1e-4)
    assert evals[0]["eval/count/chosen"] == evals[0]["eval/count/rejected"]  # each held-out pair, two rows
    assert evals[-1]["step"] == 60 and evals[-1]["eval/loss"] < 0.45 and evals[-1]["eval/rewards/margins"] > 0.5
    steps = [r for r in records if "train/loss" in r]
    assert {"train/kl", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/logps/chosen",
            "train/logps/rejected", "time/reference"} <= set(steps[-1])
    assert all(r["train/kl"] >= 0 for r in steps)
    rows = [json.loads(x) for x in task_data["grpo_eval"].read_text().splitlines()]
    before, after = greedy_exact(sft_model, rows), greedy_exact(final, rows)
    assert after >= before + 0.1, (before, after)
