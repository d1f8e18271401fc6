"""`rlkit eval`: a model scored on prompts by vLLM and the reward functions (the held-out eval's
code; that it gives a GRPO run's own eval figures is checked in test_tiny_recipes)."""

from __future__ import annotations

import json
import statistics

import pytest

from rlkit.grpo.experience import Evaluation
from rlkit.reward.contract import RewardResult
from tests.helpers import rlkit_cli


@pytest.mark.slow
def test_eval_scores_samples_with_pass_at_k_and_writes_json(tmp_path, sft_model, task_data):
    out, log = tmp_path / "eval.json", tmp_path / "engine.log"
    res = rlkit_cli("eval", str(sft_model), "--data", str(task_data["grpo_eval"]), "--rewards",
                 "rewards.exact:exact_match, rewards.exact:number_match", "--samples", "4", "--limit", "12",
                 "--max-tokens", "16", "--out", str(out), "--log", str(log), "--by", "difficulty", "--per-sample",
                 str(tmp_path / "samples.jsonl"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == "" and all(line.startswith("rlkit eval: ") for line in res.stderr.splitlines()), res.stderr
    report = json.loads(out.read_text())
    assert (report["prompts"], report["samples_per_prompt"], report["template"]) == (12, 4, "alpaca")
    assert report["data"] == str(task_data["grpo_eval"])
    assert report["sampling"]["temperature"] == 1.0 and report["sampling"]["max_tokens"] == 16
    rewards = report["rewards"]
    assert set(rewards) == {"exact_match", "number_match"} and 0 < rewards["exact_match"] <= rewards["number_match"]
    for name, mean in rewards.items():  # 0/1 rewards: pass@1 is the mean; pass@4 no lower
        assert report["pass"]["pass@1"][name] == pytest.approx(mean)
        assert mean <= report["pass"]["pass@4"][name] <= 1
    assert report["reward"] == pytest.approx(rewards["exact_match"] + rewards["number_match"])  # weights 1 and 1
    assert 0 < report["completion_tokens"]["mean"] <= 16
    assert len(report["examples"]) == 3 and all(ex["prompt"].endswith("### 回答:\n") for ex in report["examples"])
    assert "vLLM" in log.read_text() or "vllm" in log.read_text()  # the engine's own output, off the console
    # every completion with its row's columns; the means and standard errors agree with them
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [s["row"] for s in samples] == [i for i in range(12) for _ in range(4)]
    assert {s["columns"]["difficulty"] for s in samples} <= {"explain", "reasoning", "topology"}
    per_row = [sum(s["rewards"]["exact_match"] for s in samples[i * 4:(i + 1) * 4]) / 4 for i in range(12)]
    assert report["rewards"]["exact_match"] == pytest.approx(sum(per_row) / 12)
    assert report["stderr"]["exact_match"] == pytest.approx(statistics.stdev(per_row) / 12 ** 0.5)
    groups = report["by"]["difficulty"]
    assert sum(g["prompts"] for g in groups.values()) == 12
    assert sum(g["exact_match"]["mean"] * g["prompts"] for g in groups.values()) / 12 == pytest.approx(
        report["rewards"]["exact_match"])

    greedy = rlkit_cli("eval", str(sft_model), "--data", str(task_data["grpo_eval"]), "--rewards",
                    "rewards.exact:exact_match", "--limit", "12", "--max-tokens", "16", timeout=600)
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    report = json.loads(greedy.stdout)  # the JSON on stdout without --out
    assert report["sampling"]["temperature"] == 0 and list(report["pass"]) == ["pass@1"]


def test_pass_at_k_is_the_unbiased_estimate_over_rows():
    # two rows x 4 samples: row 1 has one right answer, row 2 none (and a None: not applicable)
    values = [1.0, 0.0, 0.0, 0.0, 0.0, None, 0.0, 0.0]
    result = RewardResult(total=[v or 0.0 for v in values], per_fn={"acc": values}, errors={}, seconds={})
    ev = Evaluation(rows=[{}, {}], prompts=["a", "b"], samples=[], n=4, result=result)
    assert ev.pass_at("acc", 1) == pytest.approx((0.25 + 0) / 2)
    assert ev.pass_at("acc", 2) == pytest.approx((1 - 3 / 6 + 0) / 2)  # 1 - C(3,2)/C(4,2)
    assert ev.pass_at("acc", 4) == pytest.approx((1 + 0) / 2)
    assert ev.pass_at("acc", 1, threshold=0.0) == pytest.approx((1 + 0.75) / 2)  # >= 0 passes, None does not
    # the mean over rows of each row's mean (None left out), and its standard error over rows
    assert ev.row_means("acc") == [0.25, 0.0] and ev.mean("acc") == pytest.approx(0.125)
    assert ev.stderr("acc") == pytest.approx(statistics.stdev([0.25, 0.0]) / 2 ** 0.5)
    assert ev.mean("acc", [1]) == 0.0 and ev.stderr("acc", [1]) != ev.stderr("acc", [1])  # one row: NaN


@pytest.mark.parametrize("args, message", [
    (["{model}"], "give --data and --rewards (or a --recipe that names them)"),
    (["{tmp}"], "has no config.json: give a HF model folder"),
    (["{adapter}"], "a LoRA adapter: give final/, which holds the merged model, or rlkit merge it first"),
    (["{model}", "--data", "{data}", "--rewards", "rewards.exact:exact_match", "--samples", "0"],
     "--samples: must be >= 1, got 0"),
    (["{model}", "--data", "{data}", "--rewards", "rewards.exact:no_such_fn"], "no_such_fn"),
    (["{model}", "--data", "{data}", "--rewards", "rewards.exact:exact_match", "--by", "sourse"],
     "--by: no row of {data} has a column 'sourse' (columns: "),
])
def test_bad_input_is_one_line_exit_2(tmp_path, tiny_model, task_data, args, message):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    fill = {"model": str(tiny_model), "tmp": str(tmp_path), "adapter": str(adapter),
            "data": str(task_data["grpo_eval"])}
    res = rlkit_cli("eval", *[a.format(**fill) for a in args])
    assert res.returncode == 2, res.stderr
    assert message.format(**fill) in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
