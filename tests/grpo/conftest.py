"""GRPO end-to-end helpers (the SFT-trained start model, `sft_model`, is in tests/conftest.py)."""

from __future__ import annotations

import json

from tests.helpers import ROOT

GRPO_RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"


def grpo_overrides(model, task_data, out, *extra: str) -> list[str]:
    # One engine and one learner unless a test asks for more (the recipe itself runs 2 + 2).
    return ["rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0",
            f"model.path={model}", f"data.train={task_data['grpo_train']}", f"data.eval={task_data['grpo_eval']}",
            "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
            "logging.tensorboard=false",
            *extra]


def run_metrics(run) -> list[dict]:
    """Every record of a run's metrics.jsonl."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def run_steps(run) -> list[dict]:
    """The training-step records (eval.every 0 still evaluates before the first step)."""
    return [r for r in run_metrics(run) if "reward/mean" in r]


def logged_steps(run) -> int:
    """The last step in a running run's metrics (0 before any, or while a line is half written)."""
    try:
        return max([r["step"] for r in run_steps(run)], default=0)
    except (OSError, ValueError):
        return 0
