"""Experience assembly: scoring, DAPO dynamic-sampling refills and their fallback, hand-checked.

The engines are replaced by canned samples (what `gather` returns); the rewards are the shipped
exact-match reward run by the real scorer, and the advantages the registered estimator.
"""

from __future__ import annotations

import pytest
import torch

from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.experience import Generation, advantages, collect
from rlkit.reward import RewardScorer, RewardSpec
from rlkit.rollout.samples import Sample


class Canned:
    """Stands in for the rollout engines: `gather` returns the texts given for a generation."""

    def gather(self, texts: list[str]) -> list[Sample]:
        return [Sample(i // 2, [1, 2], [3] * len(t), t, [-0.1] * len(t), "stop") for i, t in enumerate(texts)]


def _generation(answers: list[str], texts: list[str]) -> Generation:
    rows = [{"prompt": f"q{a}", "answer": a} for a in answers]
    return Generation(rows, [r["prompt"] for r in rows], texts, Canned(), started=0.0,
                      indices=[int(a) * 10 for a in answers])


@pytest.fixture()
def scorer():
    with RewardScorer([RewardSpec(fn="rewards.exact:exact_match")], parallel="none") as s:
        yield s


def test_dynamic_sampling_refills_until_enough_groups_vary(scorer):
    algo = GRPOAlgoConfig(prompts_per_step=2, group_size=2, micro_batch_size=4, dynamic_sampling=True,
                          max_refill_rounds=3)
    first = _generation(["1", "2"], ["1", "1", "2", "9"])  # group 0 all right (no signal), group 1 varies
    refills = {1: _generation(["3", "4"], ["0", "0", "4", "0"])}  # group 0 all wrong, group 1 varies
    calls = []
    exp = collect(first, lambda attempt: calls.append(attempt) or refills[attempt], scorer, algo, max_tokens=8)
    assert calls == [1]  # two varying groups after one refill: stop
    # every group scored, refills and set-aside ones included, feeds the online difficulty
    assert exp.groups == [(10, [1.0, 1.0]), (20, [1.0, 0.0]), (30, [0.0, 0.0]), (40, [1.0, 0.0])]
    assert exp.rewards == [1.0, 0.0, 1.0, 0.0]  # group "2" then group "4", in the order found
    assert [len(r.completion_ids) for r in exp.rollouts] == [1, 1, 1, 1]
    assert exp.metrics["reward/frac_zero_std"] == 0.5 and exp.metrics["dynamic_sampling/kept_groups"] == 2.0
    assert exp.metrics["reward/mean"] == 0.75  # metrics describe the first generation
    adv, _ = advantages(exp, algo)
    assert (adv != 0).all()


def test_refills_that_never_vary_fall_back_to_set_aside_groups(scorer):
    algo = GRPOAlgoConfig(prompts_per_step=2, group_size=2, micro_batch_size=4, dynamic_sampling=True,
                          max_refill_rounds=2)
    first = _generation(["1", "2"], ["1", "1", "2", "0"])
    flat = lambda attempt: _generation(["5", "6"], ["5", "5", "0", "0"])  # noqa: E731 - all groups flat
    exp = collect(first, flat, scorer, algo, max_tokens=8)
    assert exp.rewards == [1.0, 0.0, 1.0, 1.0]  # the varying group, then the first set-aside group
    assert exp.metrics["dynamic_sampling/kept_groups"] == 1.0
    adv, _ = advantages(exp, algo)
    torch.testing.assert_close(adv[2:], torch.zeros(2))  # a set-aside group carries no advantage


def test_without_dynamic_sampling_nothing_is_refilled(scorer):
    algo = GRPOAlgoConfig(prompts_per_step=2, group_size=2, micro_batch_size=4, overlong_buffer=2)
    first = _generation(["1", "2"], ["1", "1", "22", "2"])
    exp = collect(first, lambda attempt: pytest.fail("refilled"), scorer, algo, max_tokens=2)
    # soft overlong penalty: max 2, buffer 2 -> free up to 0 tokens; 1 token -> -0.5, 2 tokens -> -1
    assert exp.rewards == [0.5, 0.5, -1.0, 0.5]
    assert exp.metrics["completion/len_max"] == 2.0 and exp.metrics["reward/overlong_penalty"] == -0.625


SHAPES = []


def record_shapes(prompts, completions, prompt_texts, **kwargs):
    SHAPES.append((prompts, completions, prompt_texts))
    return [1.0] * len(completions)


def test_rewards_get_chat_data_as_trl_passes_it():
    """Chat rows give the rewards the prompt's messages and `[{"role": "assistant", ...}]`
    (TRL's GRPOTrainer shape), text rows strings; both also get the rendered prompts."""
    from rlkit.grpo.experience import score_rows

    chat = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": chat, "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]
    rendered = ["<|user|>2+2?<|assistant|>", "### 指令:\n3+3?\n\n### 回答:\n"]
    samples = Canned().gather(["4", "5", "6", "7"])
    SHAPES.clear()
    with RewardScorer([RewardSpec(fn="tests.grpo.test_experience:record_shapes")], parallel="none") as s:
        score_rows(s, rows, rendered, samples, 2)
    prompts, completions, texts = SHAPES[0]
    assert prompts == [chat, chat, "### 指令:\n3+3?\n\n### 回答:\n", "### 指令:\n3+3?\n\n### 回答:\n"]
    assert completions == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}], "6", "7"]
    assert texts == [rendered[0]] * 2 + [rendered[1]] * 2
    # TRL's own reward reads completion[0]["content"]: it works on the chat rows
    from trl.rewards import think_format_reward

    assert think_format_reward(completions[:2]) == [0.0, 0.0]
