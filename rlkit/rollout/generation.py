"""How prompts reach the rollout engines and samples come back, separate or colocated alike: the
recipe's sampling settings, each engine's `RolloutWorker` options, prompts split contiguously
over the engines, and each engine's call kept so that it can be sent again to a restarted engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkit.accel import DeviceInfo
from rlkit.actors.roles import call
from rlkit.config import ModelConfig
from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.samples import Sample, Sampling
from rlkit.rollout.worker import RolloutWorker
from rlkit.seeding import derive_seed

Prompt = str | dict  # a text, or vLLM's prompt dict: a text and its images (`multi_modal_data`)


def sampling(rollout: RolloutConfig) -> Sampling:
    """The recipe's sampling settings."""
    return Sampling(rollout.temperature, rollout.top_p, rollout.max_tokens, tuple(rollout.stop))


def worker_options(rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, seed: int,
                   adapter: AdapterServing | None = None) -> dict[str, Any]:
    """`RolloutWorker` keyword arguments of one engine, separate or colocated alike (the model's
    own tokenizer and remote code as the learners load them)."""
    llm = {"trust_remote_code": model.trust_remote_code, **({"tokenizer": model.tokenizer} if model.tokenizer else {})}
    return dict(dtype="float32" if model.dtype == "fp32" else "auto", seed=seed,
                max_model_len=rollout.max_model_len, gpu_memory_utilization=rollout.gpu_memory_utilization,
                kv_cache_gib=None if device.is_accelerator else rollout.kv_cache_gib, llm_kwargs=llm,
                cut_off_s=rollout.sync_timeout_s or None,
                **({} if adapter is None else {"lora_rank": adapter.rank, "max_loras": adapter.versions}))


@dataclass(frozen=True)
class AdapterServing:
    """`rollout.lora_sync: adapter`: engines serve the base weights plus a LoRA adapter of rank up
    to `rank`. An engine runs its calls in order, so a generation queued before a sync finishes
    with the old adapter before the new one loads; `versions` = 2 keeps the old one registered
    until the new one is in."""

    rank: int
    versions: int = 2


def shards(prompts: list[Prompt], k: int) -> list[list[Prompt]]:
    size = -(-len(prompts) // k)
    return [prompts[i * size:(i + 1) * size] for i in range(k)]


@dataclass
class EngineCall:
    """A call to engine `index`, kept so that it can be sent again to a restarted engine."""

    index: int
    method: Callable[..., Any]  # a `RolloutWorker` method (a colocated engine's learner has the same)
    args: tuple
    kwargs: dict[str, Any]
    handle: Any = None  # the engine it was last sent to
    ref: Any = None  # its Ray future
    seconds: float | None = None  # a generation's time in the engine, once gathered

    def send(self, handle: Any) -> EngineCall:
        self.handle, self.ref = handle, call(handle, self.method, *self.args, **self.kwargs)
        return self


def start_generation(handles: list[Any], prompts: list[Prompt], n: int, sampling: Sampling,
                     seed: int) -> list[EngineCall]:
    """Start `n` samples per prompt on the engines behind `handles` (actor handles with a
    `generate_timed` method); one call per engine with prompts, in prompt order."""
    return [EngineCall(i, RolloutWorker.generate_timed, (shard,),
                       dict(n=n, seed=derive_seed(seed, i), **sampling.kwargs())).send(h)
            for i, (h, shard) in enumerate(zip(handles, shards(prompts, len(handles)))) if shard]


def gathered_samples(calls: list[EngineCall], parts: list[tuple[list[Sample], float]]) -> list[Sample]:
    """The samples of gathered generate calls, prompt-major; each call keeps its engine seconds."""
    for sent, (_, seconds) in zip(calls, parts):
        sent.seconds = seconds
    return [s for samples, _ in parts for s in samples]
