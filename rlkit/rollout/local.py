"""One vLLM engine in this process, for the commands that generate without a cluster (`rlkit
eval`, the agent program's dry run before launch)."""

from __future__ import annotations

import os
from typing import Any


class LocalEngine:
    """One vLLM engine in this process, with the rollout engines' interface (generate / idle)."""

    def __init__(self, cfg: Any):
        from rlkit.accel import detect
        from rlkit.rollout.generation import worker_options
        from rlkit.rollout.worker import cpu_engine_env

        device = detect(cfg.device)
        options = worker_options(cfg.rollout, cfg.model, device, cfg.seed)
        if not device.is_accelerator:  # before vLLM is imported: it reads them then
            for key, value in cpu_engine_env(options["kv_cache_gib"]).items():
                os.environ.setdefault(key, value)
        from rlkit.rollout.worker import RolloutWorker

        self.worker = RolloutWorker(cfg.model.path, **options)

    def generate(self, prompts: list[str], n: int, sampling: Any, seed: int) -> list[Any]:
        return self.worker.generate(prompts, n, seed=seed, **sampling.kwargs())

    def idle(self) -> None:
        """The engine ends with the command."""
