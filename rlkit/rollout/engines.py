"""Rollout engines as a group: where they run, how prompts are split, how weights reach them.

Two placements behind one interface (`RolloutEngines`):
- `SeparateEngines` (default, `separate.py`): each vLLM engine in its own Ray actor and
  placement-group bundle (with its tensor-parallel devices), weights (or a LoRA adapter) pushed by learner rank 0
  through the Ray object store or an NCCL/HCCL broadcast.
- `ColocatedEngines` (`rollout.colocate`): one engine inside each learner process, weights
  handed over in-process; on accelerators the engines sleep while the learners train.

Both push through the transport row resolved once before launch (`sync_transport`), handed to
the learners inside each `SyncRequest`. Prompts are split contiguously over the engines; samples
come back prompt-major (`generation.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rlkit.accel import DeviceInfo
from rlkit.actors.calls import wait_all
from rlkit.config import ModelConfig, RayConfig
from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.generation import AdapterServing, Prompt, gathered_samples, start_generation, worker_options
from rlkit.rollout.policy import Learners
from rlkit.rollout.samples import Sample, Sampling
from rlkit.rollout.separate import SeparateEngines
from rlkit.seeding import derive_seed
from rlkit.transports import SyncRequest, Transport, resolve


class RolloutEngines(Protocol):
    """What a driver needs from its rollout engines. Every call waits at most
    `rollout.sync_timeout_s` (`start_timeout_s` for the start), then raises a `FaultError`
    naming the engine and the phase."""

    names: list[str]
    transport: Transport  # how the learners' policy reaches them (`rlkit.transports`)
    before_sync: Callable[[], None]  # what a weight sync waits for first (multi-turn rollouts in flight)

    def generate_async(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Any]: ...
    def gather(self, futures: list[Any]) -> list[Sample]: ...
    def generate(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Sample]: ...
    def sync_from(self, learners: Learners, defer: bool = False) -> dict[str, float]: ...
    def sequence_logprobs(self, sequences: list[Any]) -> list[list[list[float]]]: ...
    def recovery(self) -> dict[str, float]: ...
    def memory(self) -> list[dict[str, dict[str, int]]]: ...
    def idle(self) -> None: ...
    def shutdown(self) -> None: ...


def sync_transport(rollout: RolloutConfig, device: DeviceInfo) -> Transport:
    """The weight-sync transport `rollout.sync` means on `device` for `rollout.lora_sync`'s payload;
    a user error if it cannot run there. The driver resolves it once, before launch."""
    return resolve(rollout.sync, rollout.colocate, device.kind, device.weight_sync_backend, rollout.lora_sync)


def start_engines(rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo, ray_cfg: RayConfig,
                  learners: Learners, seed: int, transport: Transport, lora_rank: int = 0) -> RolloutEngines:
    """The recipe's engines, loaded from `model.path`, placed as `rollout.colocate` says, synced by
    `transport` (`sync_transport`); a row whose payload is the adapter starts them serving LoRA
    adapters of rank up to `lora_rank` (the recipe's `lora.r`)."""
    if rollout.colocate:
        return ColocatedEngines(learners, rollout, model, device, seed, transport)
    adapter = AdapterServing(lora_rank) if transport.payload.adapter else None
    return SeparateEngines(rollout, model, device, ray_cfg, seed, learners, transport, adapter)


class ColocatedEngines:
    """One engine inside each learner process (`Learner.start_engine`); the learner group owns
    the actors."""

    def __init__(self, learners: Learners, rollout: RolloutConfig, model: ModelConfig, device: DeviceInfo,
                 seed: int, transport: Transport):
        self.learners, self.timeout, self.transport = learners, rollout.sync_timeout_s or None, transport
        self.names = [f"engine {rank} (in learner {rank})" for rank in range(learners.size)]
        self.before_sync: Callable[[], None] = lambda: None  # what a sync waits for first (multi-turn rollouts)
        options = [{**worker_options(rollout, model, device, derive_seed(seed, "engine", rank, bits=31)),
                    "index": rank, "cut_off_s": None} for rank in range(learners.size)]  # the learner's watch is theirs
        learners.start_engines(model.path, [{**o, "sleep_mode": rollout.sleep} for o in options],
                               rollout.start_timeout_s or None)

    def generate_async(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Any]:
        return start_generation(self.learners.actors, prompts, n, sampling, seed)

    def gather(self, futures: list[Any]) -> list[Sample]:
        parts = wait_all([c.ref for c in futures], [self.names[c.index] for c in futures], "the generation",
                         self.timeout)
        return gathered_samples(futures, parts)

    def generate(self, prompts: list[Prompt], n: int, sampling: Sampling, seed: int) -> list[Sample]:
        return self.gather(self.generate_async(prompts, n, sampling, seed))

    def sync_from(self, learners: Learners, defer: bool = False) -> dict[str, float]:
        """Every rank loads its own engine (a colocated transport: nothing to defer); rank 0's stats."""
        self.before_sync()
        return learners.push_weights(SyncRequest(self.transport, timeout_s=self.timeout))[0]

    def sequence_logprobs(self, sequences: list[Any]) -> list[list[list[float]]]:
        return self.learners.engine_sequence_logprobs(sequences, self.timeout)

    def recovery(self) -> dict[str, float]:
        """None: a colocated engine dies with its learner, which ends the run."""
        return {}

    def memory(self) -> list[dict[str, dict[str, int]]]:
        """Nothing apart: a colocated engine's memory is its learner's process (`LearnerGroup.memory`)."""
        return []

    def idle(self) -> None:
        """Generation is over until the next sync: on accelerators the engines sleep (vLLM sleep
        mode) so the learners get the device memory back."""
        self.learners.sleep_engines()

    def shutdown(self) -> None:
        """Nothing of its own: the engines go with the learner actors."""
