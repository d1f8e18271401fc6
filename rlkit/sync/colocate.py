"""A vLLM engine inside a learner's process (colocated placement: verl's hybrid engine, TRL's
colocate). The learner actor owns one and forwards to it; weights reach it by reference.

With several learner ranks vLLM joins their torch.distributed world (`external_launcher`);
each rank's engine is an independent replica (tensor parallel size 1). On accelerators vLLM's
sleep mode frees the engine's memory while the learner trains.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from rlkit.rollout.buckets import NamedTensor
from rlkit.rollout.samples import Sample
from rlkit.rollout.worker import RolloutWorker, cpu_engine_env
from rlkit.sync.weight_sync import SyncTarget, open_transport
from rlkit.transports import Transport


class ColocatedEngine:
    """Start with the engine's `RolloutWorker` options; `world_size` > 1 makes vLLM join the
    learners' process group instead of starting its own."""

    def __init__(self, model_path: str, options: dict[str, Any], world_size: int, on_accelerator: bool):
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not on_accelerator:
            env = cpu_engine_env(options.get("kv_cache_gib"), torch.get_num_threads())
        for key, value in env.items():
            os.environ.setdefault(key, value)
        options = dict(options)
        llm_kwargs = dict(options.pop("llm_kwargs", None) or {})
        if world_size > 1:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        self.worker = RolloutWorker(model_path, llm_kwargs=llm_kwargs, **options)
        self.asleep = False

    def generate(self, *args: Any, **kwargs: Any) -> list[Sample]:
        """`RolloutWorker.generate`, waking the engine first."""
        self._wake()
        return self.worker.generate(*args, **kwargs)

    def generate_timed(self, *args: Any, **kwargs: Any) -> tuple[list[Sample], float]:
        """`RolloutWorker.generate_timed`, waking the engine first (the wake-up is not busy time)."""
        self._wake()
        return self.worker.generate_timed(*args, **kwargs)

    def sequence_logprobs(self, sequences: list[Any]) -> list[list[float]]:
        """`RolloutWorker.sequence_logprobs` (weight checks)."""
        self._wake()
        return self.worker.sequence_logprobs(sequences)

    def sleep(self) -> None:
        """Free the engine's device memory (KV cache, weights to host) until the next call; vLLM
        sleep mode, accelerators only (`rollout.sleep`)."""
        if self.worker.sleep_enabled and not self.asleep:
            self.worker.llm.sleep(level=1)
            self.asleep = True

    def load_weights(self, transport: Transport, named: Iterable[NamedTensor]) -> dict[str, float]:
        """Load the learner's current weights in place by a colocated `transport` (in_process: by
        reference, no copy, no serialisation)."""
        self._wake(["weights"])
        return open_transport(transport, SyncTarget(self.worker)).push(named).as_dict()

    def _wake(self, tags: list[str] | None = None) -> None:
        if self.asleep:
            self.worker.llm.wake_up(tags=tags)
            self.asleep = tags is not None and "kv_cache" not in tags


class EngineHost:
    """The learner actor's side of a colocated engine (`Learner` takes these methods): the driver
    starts, calls and puts to sleep the engine in each learner's process through its learner."""

    colocated: ColocatedEngine | None
    world_size: int
    device_info: Any

    def start_engine(self, model_path: str, options: dict[str, Any]) -> float:
        """Start a vLLM engine in this process; returns its start seconds."""
        self.colocated = ColocatedEngine(model_path, options, self.world_size, self.device_info.is_accelerator)
        return self.colocated.worker.ready()

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self.colocated.generate(*args, **kwargs)

    def generate_timed(self, *args: Any, **kwargs: Any) -> tuple[list[Any], float]:
        return self.colocated.generate_timed(*args, **kwargs)

    def engine_sequence_logprobs(self, sequences: list[Any]) -> list[list[float]]:
        return self.colocated.sequence_logprobs(sequences)

    def sleep_engine(self) -> None:
        if self.colocated is not None:
            self.colocated.sleep()
