"""Shared fixtures: the offline tiny models and the synthetic task, built once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Directory of the tied-embedding tiny Qwen2 (hidden 128, 2 layers, vocab 512)."""
    from rlkit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), "tiny")


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    """Paths of the synthetic arithmetic task (sft_train, sft_eval, grpo_train, grpo_eval)."""
    from rlkit.tiny import write_task_data

    return write_task_data(tmp_path_factory.mktemp("task-data"), seed=0)


@pytest.fixture()
def ray_local():
    """A local Ray instance for one test (rlkit's own runs start and stop their own otherwise)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()
