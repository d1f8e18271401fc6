"""The learner group: `num` Learner actors forming one torch.distributed group.

Each method runs on every rank at once and returns when all are done: the same arguments
for all ranks, or one argument per rank where each rank has its own shard (`per_rank`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from rlkit.accel import DeviceInfo
from rlkit.actors.calls import Started, unwatch_nodes, wait_all, watch_nodes
from rlkit.actors.placement import placement_group
from rlkit.actors.roles import Role, call
from rlkit.config import RayConfig
from rlkit.learner.actor import Learner, LearnerSpec
from rlkit.learner.objective import FitResult, MicroBatch, Objective, StepMetrics
from rlkit.transports import SyncRequest

SLACK_S = 30.0  # extra wait for a learner whose engine calls each have the timeout
P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[Learner, P], R]


class LearnerGroup:
    """Start `num` learners in a placement group (one bundle per rank), join their process group
    and build their engines. The start goes on in the actors while the caller starts other roles
    (the rollout engines): `ready` waits for it, and every call to the learners waits for it first."""

    def __init__(self, spec: LearnerSpec, num: int, device: DeviceInfo, ray_cfg: RayConfig,
                 output_dir: Path | None = None):
        from rlkit.actors.cluster import check_nodes_see, pg_nodes

        custom = ray_cfg.resources.learner
        self.pg = placement_group(device, num, ray_cfg.cpus_per_actor, ray_cfg.placement, custom=custom)
        check_nodes_see(pg_nodes(self.pg), "learners", output_dir, spec.model.path)
        role = Role.of(Learner, "learner", device, ray_cfg)
        self.actors = [role.start(spec, rank, num, name=f"learner {rank}", group=self.pg, bundle=rank)
                       for rank in range(num)]
        watch_nodes(self.pg, self.owners)
        where = call(self.actors[0], Learner.address)  # each rank joins once rank 0 has said where
        self._starting: tuple[Any, list[Any], list[Any]] | None = (
            where, [call(a, Learner.init_process_group, where) for a in self.actors],
            [call(a, Learner.build) for a in self.actors])
        self._info: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        """Wait for the learners' start (rank 0's address, the process group, each rank's build);
        rank 0's summary of its build."""
        if self._starting is not None:
            where, joined, built = self._starting
            wait_all([where], self.owners[:1], "its start")
            wait_all(joined, self.owners, Learner.init_process_group.__name__)
            self._info = wait_all(built, self.owners, Learner.build.__name__)[0]
            self._starting = None
        return self._info

    @property
    def size(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------ training

    def train_step(self, per_rank: Sequence[list[MicroBatch]], objective: Objective) -> list[StepMetrics]:
        """One optimizer step: rank r runs `per_rank[r]` (its `grad_accum` micro-batches)."""
        return self._each(Learner.train_step, [(mbs, objective) for mbs in per_rank], phase="the training step")

    def fit(self, per_rank: Sequence[list[list[MicroBatch]]], objective: Objective, epochs: int = 1) -> list[FitResult]:
        """`Learner.fit` on every rank with its own optimizer steps."""
        return self.fit_async(per_rank, objective, epochs)()

    def fit_async(self, per_rank: Sequence[list[list[MicroBatch]]], objective: Objective,
                  epochs: int = 1) -> Started:
        """`fit`, started: returns at once with the calls (calling them waits for their results)."""
        return Started(self._send(Learner.fit, [(steps, objective, epochs) for steps in per_rank]), self.owners,
                       "the training step")

    def evaluate(self, per_rank: Sequence[list[MicroBatch]], objective: Objective) -> dict[str, float]:
        """Metric sums of `Learner.evaluate` over all ranks."""
        total: dict[str, float] = {}
        for sums in self._each(Learner.evaluate, [(mbs, objective) for mbs in per_rank]):
            for key, value in sums.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def logprobs(self, per_rank: Sequence[list[MicroBatch]], model: str,
                 positions: Callable[[MicroBatch], Any] | None = None) -> list[list[Any]]:
        """Each rank's `Learner.logprobs` of its micro-batches under `model` ("policy",
        "reference"), at `positions(micro_batch)`: [B, L-1] CPU tensors per micro-batch."""
        return self._each(Learner.logprobs, [(mbs, 1.0, model, positions) for mbs in per_rank],
                          phase=f"the {model}'s logprobs")

    def mix_reference(self, alpha: float) -> None:
        """`Learner.mix_reference` on every rank (TR-DPO)."""
        self._all(Learner.mix_reference, alpha)

    # ------------------------------------------------------------------ weights

    def push_weights(self, request: SyncRequest) -> list[dict[str, Any] | None]:
        """Current policy -> the rollout engines as `request` asks (`rlkit.transports`): see
        `Learner.push_weights`. Each rank's `SyncStats` dict (None on the ranks that only take part
        in ZeRO-3 gathers). Each engine call may take the request's `timeout_s` (a `FaultError`
        naming the engine); the learners get `SLACK_S` more, so a hung engine is named before its learner."""
        limit = request.timeout_s and request.timeout_s + SLACK_S
        return self._timed(Learner.push_weights, "the weight sync", limit, request)

    def sequence_logprobs(self, sequences: list[list[int]], pixels: dict[str, Any] | None = None) -> list[list[float]]:
        """Rank 0's `Learner.sequence_logprobs` (all ranks take part, for ZeRO-3)."""
        return self._all(Learner.sequence_logprobs, sequences, pixels)[0]

    def named_weights(self) -> list[tuple[str, Any]]:
        """The current policy (LoRA merged) as (HF name, CPU tensor), from rank 0."""
        return self._all(Learner.named_weights)[0]

    # ------------------------------------------------------------------ colocated engines

    def start_engines(self, model_path: str, per_rank_options: Sequence[dict[str, Any]],
                      timeout_s: float | None = None) -> list[float]:
        """A vLLM engine in each learner process (`Learner.start_engine`); start seconds per rank."""
        return self._each(Learner.start_engine, [(model_path, options) for options in per_rank_options], timeout_s,
                          phase="its engine's start", knob="rollout.start_timeout_s")

    def engine_sequence_logprobs(self, sequences: list[Any],
                                 timeout_s: float | None = None) -> list[list[list[float]]]:
        """Each rank's colocated engine scores `sequences` (weight checks)."""
        return self._timed(Learner.engine_sequence_logprobs, "the sync check", timeout_s, sequences)

    def sleep_engines(self) -> None:
        self._all(Learner.sleep_engine)

    # ------------------------------------------------------------------ checkpoints and lifecycle

    def memory(self) -> list[dict[str, dict[str, int]]]:
        """Each rank's memory before its model was built and now (see `Learner.memory`)."""
        return self._all(Learner.memory)

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        self._timed(Learner.save_checkpoint, "the checkpoint", None, str(ckpt_dir))

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        self._all(Learner.load_checkpoint, str(ckpt_dir))

    def save_model(self, out_dir: str | Path, tokenizer_dir: str) -> Path:
        """The final model from rank 0 (see `Learner.save_model`)."""
        self._all(Learner.save_model, str(out_dir), tokenizer_dir)
        return Path(out_dir)

    def shutdown(self) -> None:
        import ray

        unwatch_nodes(self.owners)
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        ray.util.remove_placement_group(self.pg)

    def _all(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self._timed(method, method.__name__, None, *args, **kwargs)

    def _timed(self, method: Method[P, R], phase: str, timeout_s: float | None, *args: P.args,
               **kwargs: P.kwargs) -> list[R]:
        """`method(*args)` on every rank; the first rank to fail ends the wait (see `wait_all`)."""
        self.ready()
        futures = [call(a, method, *args, **kwargs) for a in self.actors]
        return wait_all(futures, self.owners, phase, timeout_s)

    def _each(self, method: Method[..., R], per_rank_args: Sequence[tuple], timeout_s: float | None = None,
              phase: str | None = None, knob: str = "rollout.sync_timeout_s") -> list[R]:
        return wait_all(self._send(method, per_rank_args), self.owners, phase or method.__name__, timeout_s, knob)

    def _send(self, method: Method[..., R], per_rank_args: Sequence[tuple]) -> list[Any]:
        """`method` on each rank with that rank's arguments (`per_rank_args[rank]`): the futures."""
        if len(per_rank_args) != len(self.actors):
            raise ValueError(f"{method.__name__}: {len(per_rank_args)} shards for {len(self.actors)} learners")
        self.ready()
        return [call(a, method, *args) for a, args in zip(self.actors, per_rank_args)]

    @property
    def owners(self) -> list[str]:
        return [f"learner {rank}" for rank in range(len(self.actors))]
