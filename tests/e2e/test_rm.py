"""`rlkit rm recipes/tiny-rm.yaml` end to end on the tiny model: a reward model from the SFT model on
the synthetic task's pairs ranks the held-out pairs, its final/ scores in GRPO's
`rewards.model:RewardModel` as it is (the trained template, the score head), and GRPO with it as
the only reward learns the task; an LLM judge on engines of its own scores beside it."""

from __future__ import annotations

import json

import pytest

from rlkit import stages
from tests.helpers import GRPO_RECIPE, ROOT, grpo_overrides, pair_overrides, run_metrics
from tests.workers import once


@pytest.fixture(scope="module")
def trained_rm(sft_model, task_data, tmp_path_factory):
    """The run folder of `recipes/tiny-rm.yaml` (full fine-tuning, 60 steps) from the SFT model."""
    from rlkit.rm.run import run_rm

    def build(out):
        run_rm(stages.load("rm", ROOT / "recipes" / "tiny-rm.yaml", pair_overrides(sft_model, task_data, out)))
        return out

    return once(tmp_path_factory, "rm-full", build)


@pytest.mark.slow  # a 60-step run beside the SFT model it starts from
@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_the_reward_model_ranks_held_out_pairs_and_scores_in_grpo_as_trained(sft_model, task_data, tmp_path,
                                                                              finetuning, request):
    """60 steps of TRL's Bradley-Terry loss: on the held-out pairs the loss falls from log 2 (the new
    score head's margins start near 0: measured 0.006, though their signs already order 0.67 of the
    pairs) to about 0.35, the margin grows past 1 and the pairwise accuracy ends at 0.85 or more
    (measured 0.87; LoRA: the adapters and the score head), and `rewards.model:RewardModel` on
    final/ scores the held-out prompts' chosen answers above their rejected ones as often."""
    from rewards.model import RewardModel
    from rlkit.data.templates import render_alpaca
    from rlkit.rm.run import run_rm

    if finetuning == "full":  # the run the GRPO test below scores with
        out = request.getfixturevalue("trained_rm")
    else:
        out = tmp_path
        lora = ["finetuning=lora", "lora.r=16", "lora.alpha=32", "optim.lr=3e-3"]
        run_rm(stages.load("rm", ROOT / "recipes" / "tiny-rm.yaml", pair_overrides(sft_model, task_data, out, *lora)))
    final = out / "final"
    evals = [r for r in run_metrics(out) if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60
    assert evals[0]["eval/loss"] == pytest.approx(0.6931, abs=0.01) and abs(evals[0]["eval/margin"]) < 0.1
    assert evals[-1]["eval/loss"] < 0.45 and evals[-1]["eval/margin"] > 1.0 and evals[-1]["eval/accuracy"] >= 0.85
    pairs = [json.loads(x) for x in task_data["dpo_eval"].read_text().splitlines()]
    prompts = [render_alpaca(p["instruction"], p["input"]) for p in pairs]  # GRPO's prompt of an alpaca row
    rm = RewardModel(str(final), batch_size=16)
    chosen, rejected = rm(prompts, [p["chosen"] for p in pairs]), rm(prompts, [p["rejected"] for p in pairs])
    served = sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)
    assert served >= evals[-1]["eval/accuracy"] - 0.05, (served, evals[-1]["eval/accuracy"])


@pytest.mark.slow  # 12 GRPO steps with the reward model's actor and the judge's engine beside the run's
def test_grpo_with_the_reward_model_as_its_only_reward_learns_and_a_judge_scores_on_engines_of_its_own(
        ray_module, trained_rm, sft_model, task_data, tmp_path):
    """The reward model, served from its own actor, is the only reward with a weight: the held-out
    exact-answer accuracy (greedy, logged by a zero-weight exact match) rises from the SFT model's
    (measured 0.08 -> 0.54). An LLM judge (zero weight) asks the SFT model, on a vLLM engine of its
    own, each prompt's question and reads its answer as a score on [0, 9]: the same question gets
    the same greedy reply whatever the policy has become (its engine is not the policy's, which
    takes new weights every step), so its held-out score never moves while the accuracy does; a
    reply past 9 has no score it can read and is counted, a whole group at a time, never a failed step."""
    from rlkit.grpo.run import run_grpo

    out = tmp_path / "grpo"
    rewards = (f"rewards=[{{fn: 'rewards.model:RewardModel', weight: 1.0, args: {{path: '{trained_rm / 'final'}', "
               "ray_actor: true, num_cpus: 0, batch_size: 32}}, {fn: 'rewards.exact:exact_match', weight: 0.0}, "
               f"{{fn: 'rewards.llm_judge:LLMJudge', weight: 0.0, args: {{path: '{sft_model}', template: '{{prompt}}', "
               "chat: false, scale: [0, 9], max_tokens: 8, num_cpus: 0, max_model_len: 128, kv_cache_gib: 0.5}}]")
    cfg = stages.load("grpo", GRPO_RECIPE, grpo_overrides(sft_model, task_data, out, "grpo.steps=12", "eval.every=12",
                                                          "checkpoint.every=0", "curriculum.enabled=false", rewards))
    run_grpo(cfg, GRPO_RECIPE)
    rows = run_metrics(out)
    evals = [r for r in rows if "eval/exact_match" in r]
    assert [r["step"] for r in evals] == [0, 12]
    assert evals[-1]["eval/exact_match"] > evals[0]["eval/exact_match"] + 0.2, evals
    assert evals[-1]["eval/RewardModel"] > evals[0]["eval/RewardModel"] + 1.0, evals
    assert evals[-1]["eval/LLMJudge"] == evals[0]["eval/LLMJudge"] and 0 < evals[0]["eval/LLMJudge"] < 1, evals
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 12 and all(r["reward/mean"] == r["reward/RewardModel/mean"] for r in steps)
    errors = [r["reward/LLMJudge/errors"] for r in steps]
    assert all(e % 8 == 0 for e in errors) and 0 < sum(errors) < 12 * 64, errors
