"""GRPO end-to-end helpers (the SFT-trained start model, `sft_model`, is in tests/conftest.py)."""

from __future__ import annotations

from tests.sft.conftest import ROOT

GRPO_RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"


def grpo_overrides(model, task_data, out, *extra: str) -> list[str]:
    # One engine and one learner unless a test asks for more (the recipe itself runs 2 + 2).
    return ["rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0",
            f"model.path={model}", f"data.train={task_data['grpo_train']}", f"data.eval={task_data['grpo_eval']}",
            "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
            "logging.tensorboard=false",
            *extra]
