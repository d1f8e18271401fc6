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


@pytest.mark.slow  # three 6-step runs (~30 s)
def test_a_dpo_run_killed_mid_run_resumes_to_the_uninterrupted_runs_end(sft_model, task_data, tmp_path, monkeypatch):
    """Learner 0 dies in step 5 of 6 (checkpoints every 2 steps): the rerun resumes from step 4
    and logs the uninterrupted run's losses and rewards at steps 5-6 and on the held-out pairs,
    and ends with its weights. With `precompute_ref_log_probs` (and padding-free rows) the
    checkpoint carries the reference's logprobs, scored once before step 1 by the starting policy
    (the learners hold no frozen copy, and the resumed policy is no longer the reference)."""
    from safetensors.torch import load_file

    from rlkit.dpo.run import run_dpo
    from rlkit.errors import FaultError

    def run(out):
        return run_dpo(stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml", pair_overrides(
            sft_model, task_data, out, "train.max_steps=6", "checkpoint.every=2", "eval.every=3",
            "eval.max_batches=2", "dpo.precompute_ref_log_probs=true", "dpo.padding_free=true")))

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
    assert "; padding-free rows; " in plan and "reference: the starting policy, once before training" in plan
    assert re.search(r"the reference's logprobs of \d+ pairs computed in", plan)


@pytest.mark.slow  # a one-learner run and a two-learner ZeRO-3 run stopped and resumed, 6 steps each (~35 s)
def test_tr_dpo_on_two_zero3_learners_killed_and_resumed_logs_the_one_learner_runs_losses(sft_model, task_data,
                                                                                          tmp_path, monkeypatch):
    """TR-DPO (the reference moved toward the policy at steps 2 and 4, alpha 0.5) on two ZeRO-3
    learners with padding-free rows, learner 1 killed in step 5 and the run resumed from step 4,
    logs the losses and rewards of one uninterrupted ZeRO-0 learner with padded rows on the same 8
    pairs a step, at every step. Each rank gathers the partitioned policy to move its whole
    reference copy, and the checkpoint carries the moved copy: a copy moved toward a partition, or
    the starting model read back on resume, parts the runs after step 2 or step 4."""
    from rlkit.dpo.run import run_dpo
    from rlkit.errors import FaultError

    common = ["train.max_steps=6", "dpo.sync_ref_model=true", "dpo.ref_model_sync_steps=2", "optim.lr=1e-3",
              "dpo.ref_model_mixup_alpha=0.5", "eval.every=0", "eval.max_batches=2", "checkpoint.every=2"]
    layouts = {"one": ["train.num_learners=1", "train.micro_batch_size=8"],
               "zero3": ["train.num_learners=2", "train.micro_batch_size=4", "deepspeed.zero_stage=3",
                         "dpo.padding_free=true"]}

    def run(name):
        return run_dpo(stages.load("dpo", ROOT / "recipes" / "tiny-dpo.yaml",
                                   pair_overrides(sft_model, task_data, tmp_path / name, *common, *layouts[name])))

    run("one")
    monkeypatch.setenv("RLKIT_FAULT", "die:fit:learner1:4")
    with pytest.raises(FaultError, match="learner 1 died during the training step"):
        run("zero3")
    monkeypatch.delenv("RLKIT_FAULT")
    assert (tmp_path / "zero3" / "checkpoints" / "step-4" / "reference.pt").is_file()
    run("zero3")
    keys = ("train/loss", "train/rewards/margins", "train/logps/chosen")
    logged = {name: {r["step"]: [r[k] for k in keys] for r in run_metrics(tmp_path / name) if "train/loss" in r}
              for name in layouts}
    assert sorted(logged["one"]) == sorted(logged["zero3"]) == list(range(1, 7))
    assert logged["one"][6][0] < logged["one"][1][0]
    for step, one in logged["one"].items():
        assert logged["zero3"][step] == pytest.approx(one, rel=1e-3, abs=1e-4), (step, logged)
    assert "moved toward the policy every 2 steps (alpha 0.5)" in (tmp_path / "zero3" / "rlkit.log").read_text()


@pytest.mark.slow  # an 8-step LoRA or QLoRA run (~12 s)
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_llamafactorys_dpo_example_form_runs_as_it_is(sft_model, task_data, tmp_path, method):
    """`rlkit dpo recipes/llamafactory/tiny_lora_dpo.yaml`: LLaMA-Factory's LoRA DPO example in its
    own flat form, the pairs named by their dataset_info.json entry, trains (here 8 steps from
    the SFT model; and with 4-bit base weights): the policy starts as its reference (LoRA's B is
    0, and the reference is the policy with its adapters disabled: the loss is log 2), the loss
    falls, and the final folder holds the adapter and the merged model."""
    from rlkit.dpo.run import run_dpo

    out = tmp_path / method
    quantised = ["finetuning=qlora", "qlora.compute_dtype=fp32"] if method == "qlora" else []
    cfg = stages.load("dpo", ROOT / "recipes" / "llamafactory" / "tiny_lora_dpo.yaml", [
        f"model.path={sft_model}", f"data.train={task_data['dataset_info']}", f"output_dir={out}", "train.max_steps=8",
        "logging.progress=none", "logging.tensorboard=false", *quantised])
    assert cfg.finetuning == method and cfg.data.dataset == "tiny_dpo_train"
    final = run_dpo(cfg)
    losses = [r["train/loss"] for r in run_metrics(out) if "train/loss" in r]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3) and losses[-1] < losses[0] - 0.015, losses  # 0.665 measured
    assert (final / "adapter" / "adapter_config.json").is_file() and list(final.glob("*.safetensors"))
