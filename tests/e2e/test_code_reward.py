"""GRPO with the sandboxed code reward on the tiny model: it still learns.

The tiny model first learns (SFT) to answer an arithmetic prompt with a Python program that prints
the answer in the SFT teacher's three styles (`print(19)`, `print("答案是19")`, `print("结果: 19")`);
each prompt's test case is stdin/stdout (its stdout must be `19`), so only the bare style passes.
GRPO with `rewards.code:code_reward` alone (every completion judged in its own bubblewrap sandbox)
then moves the policy to the style the judge accepts, on training and on held-out prompts.
"""

from __future__ import annotations

import json

import pytest

from rlkit import stages
from rlkit.sandbox.walls import namespaces_problem
from tests.helpers import GRPO_RECIPE, ROOT, grpo_overrides, run_metrics, sft_overrides

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(namespaces_problem() is not None, reason=f"no sandbox: {namespaces_problem()}")]
STYLES = ("{}", '"答案是{}"', '"结果: {}"')


def _code_task(task_data, out):
    """The arithmetic task with programs for answers (SFT) and a stdout test per prompt (GRPO)."""
    paths = {}
    for name in ("sft_train", "sft_eval", "grpo_train", "grpo_eval"):
        rows = [json.loads(line) for line in task_data[name].read_text(encoding="utf-8").splitlines()]
        for i, r in enumerate(rows):
            answer = r["output"].removeprefix("答案是").removeprefix("结果: ")
            if name.startswith("sft"):
                r["output"] = f"```python\nprint({STYLES[i % 3].format(answer)})\n```"
            else:
                r["test_cases"] = [{"input": "", "output": answer}]
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return paths


def test_grpo_with_the_sandboxed_code_reward_learns(ray_module, tiny_model, task_data, tmp_path):
    from rlkit.grpo.run import run_grpo
    from rlkit.sft.run import run_sft

    data = _code_task(task_data, tmp_path)
    sft = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml",
                      sft_overrides(tiny_model, data, tmp_path / "sft", "train.max_steps=600", "eval.every=0",
                                    "checkpoint.every=0"))
    start = run_sft(sft)
    out = tmp_path / "grpo"
    cfg = stages.load("grpo", GRPO_RECIPE, grpo_overrides(
        start, data, out, "grpo.steps=20", "eval.every=10", "checkpoint.every=0", "curriculum.enabled=false",
        "rollout.max_tokens=32", "rewards=[{fn: 'rewards.code:code_reward', args: {timeout_s: 10.0}}]"))
    run_grpo(cfg, GRPO_RECIPE)
    rows = run_metrics(out)
    train = [r["reward/code_reward/mean"] for r in rows if "reward/code_reward/mean" in r]
    evals = [r["eval/reward"] for r in rows if r.get("eval/reward") is not None]
    assert len(train) == 20 and len(evals) == 3
    first, last = sum(train[:5]) / 5, sum(train[-5:]) / 5
    assert 0.0 < first < 0.5, train  # the SFT start writes programs, some of them right (measured: 0.09)
    assert last > first + 0.04, f"train reward did not rise: {train}"  # measured: 0.17
    assert evals[-1] > evals[0] + 0.1, f"held-out pass rate did not rise: {evals}"  # measured: 0.00 -> 0.30
    # every sample judged: none killed at its limit (10 s: a print takes well under 1 s alone, but 2 s was once
    # passed beside another run on two cores; tests/rewards/test_code.py holds the limit itself)
    assert all(r["reward/code_reward/errors"] == 0 for r in rows if "reward/code_reward/errors" in r)
