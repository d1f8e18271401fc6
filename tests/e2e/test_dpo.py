"""`rlkit dpo recipes/tiny-dpo.yaml` end to end on the tiny model: DPO from the SFT model on the
synthetic task's pairs (`rlkit/tiny.py`) learns what the pairs prefer on prompts it never saw."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow  # three 6-step runs (~35 s)
@pytest.mark.parametrize("variant", ["precomputed-padding-free", "tr-dpo"])
def test_a_dpo_run_killed_mid_run_resumes_to_the_uninterrupted_runs_end(sft_model, task_data, tmp_path, monkeypatch,
                                                                       variant):
    """Learner 0 dies in step 5 of 6 (checkpoints every 2 steps): the rerun resumes from step 4
    and logs the uninterrupted run's losses and rewards at steps 5-6 and on the held-out pairs,
    and ends with its weights. `precompute_ref_log_probs` (with padding-free rows): the checkpoint
    carries the reference's logprobs, scored once before step 1 by the starting policy (the
    learners hold no frozen copy, and the resumed policy is no longer the reference).
    `sync_ref_model` (TR-DPO): the checkpoint carries the reference copy the learners moved
    toward the policy at steps 2 and 4."""
    from safetensors.torch import load_file

    from rlkit.dpo.run import run_dpo
    from rlkit.errors import FaultError

    extra = {"precomputed-padding-free": ["dpo.precompute_ref_log_probs=true", "dpo.padding_free=true"],
             "tr-dpo": ["dpo.sync_ref_model=true", "dpo.ref_model_sync_steps=2", "dpo.ref_model_mixup_alpha=0.5"]}

    def run(out):
        return run_dpo(stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", pair_overrides(
            sft_model, task_data, out, "train.max_steps=6", "checkpoint.every=2", "eval.every=3",
            "eval.max_batches=2", *extra[variant])))

    clean = run(tmp_path / "clean")
    monkeypatch.setenv("RLKIT_FAULT", "die:fit:learner0:4")
    with pytest.raises(FaultError, match="learner 0 died during the training step"):
        run(tmp_path / "broken")
    monkeypatch.delenv("RLKIT_FAULT")
    assert sorted(p.name for p in (tmp_path / "broken" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    resumed = run(tmp_path / "broken")
    keys = ("train/loss", "train/rewards/chosen", "train/rewards/margins", "eval/loss", "eval/rewards/accuracies")
    want = {r["step"]: [r.get(k) for k in keys] for r in run_metrics(tmp_path / "clean") if r["step"] > 4}
    got = {r["step"]: [r.get(k) for k in keys] for r in run_metrics(tmp_path / "broken") if r["step"] > 4}
    assert got == want and len(want) == 2 and want[6][3] is not None
    weights = [load_file(next(Path(d).glob("*.safetensors"))) for d in (clean, resumed)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    plan = (tmp_path / "clean" / "rlkit.log").read_text()
    if variant == "tr-dpo":
        assert (tmp_path / "broken" / "checkpoints" / "step-4" / "reference.pt").is_file()
        assert "moved toward the policy every 2 steps (alpha 0.5)" in plan
    else:
        assert "; padding-free rows; " in plan and "reference: the starting policy, once before training" in plan
        assert re.search(r"the reference's logprobs of \d+ pairs computed in", plan)


@pytest.mark.slow  # a one-learner and a two-learner ZeRO-3 run of 5 steps (~35 s)
def test_tr_dpo_on_two_zero3_learners_logs_the_one_learner_runs_losses(sft_model, task_data, tmp_path):
    """TR-DPO (the reference moved at steps 2 and 4) on two ZeRO-3 learners with padding-free rows
    (each rank gathers the partitioned policy to move its whole reference copy; the lm_head's calls
    evened across ranks) logs the losses and rewards of one ZeRO-0 learner with padded rows on the
    same 8 pairs a step: a reference moved toward a partition rather than the whole policy, or a
    row scored across another, would part them after step 2."""
    from rlkit.dpo.run import run_dpo

    common = ["train.max_steps=5", "dpo.sync_ref_model=true", "dpo.ref_model_sync_steps=2", "optim.lr=1e-3",
              "dpo.ref_model_mixup_alpha=0.5", "eval.every=0", "eval.max_batches=2"]
    layouts = {"one": ["train.num_learners=1", "train.micro_batch_size=8"],
               "zero3": ["train.num_learners=2", "train.micro_batch_size=4", "deepspeed.zero_stage=3",
                         "dpo.padding_free=true"]}
    keys = ("train/loss", "train/rewards/margins", "train/logps/chosen")
    logged = {}
    for name, layout in layouts.items():
        run_dpo(stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml",
                            pair_overrides(sft_model, task_data, tmp_path / name, *common, *layout)))
        logged[name] = [[r[k] for k in keys] for r in run_metrics(tmp_path / name) if "train/loss" in r]
    assert len(logged["one"]) == 5 and logged["one"][4][0] < logged["one"][0][0]
    for one, zero3 in zip(logged["one"], logged["zero3"], strict=True):
        assert zero3 == pytest.approx(one, rel=1e-3, abs=1e-4), (logged["one"], logged["zero3"])
