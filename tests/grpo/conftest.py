"""GRPO end-to-end fixtures: a briefly SFT-trained tiny model to start from."""

from __future__ import annotations

import pytest

from tests.sft.conftest import ROOT, sft_overrides

GRPO_RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"


@pytest.fixture(scope="session")
def sft_model(tiny_model, task_data, tmp_path_factory):
    """The tiny model after 600 SFT steps (~70 s): it knows some facts and the teacher's three
    answer styles, so an exact-answer reward has signal."""
    import ray

    from rlkit import stages
    from rlkit.sft.run import run_sft

    out = tmp_path_factory.mktemp("sft-start")
    cfg = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml",
                      sft_overrides(tiny_model, task_data, out, "train.max_steps=600", "eval.every=0",
                                    "checkpoint.every=0"))
    final = run_sft(cfg)
    assert not ray.is_initialized()
    return final


def grpo_overrides(model, task_data, out, *extra: str) -> list[str]:
    # One engine and one learner unless a test asks for more (the recipe itself runs 2 + 2).
    return ["rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0",
            f"model.path={model}", f"data.train={task_data['grpo_train']}", f"data.eval={task_data['grpo_eval']}",
            "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
            "logging.tensorboard=false",
            *extra]
