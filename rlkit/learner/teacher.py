"""A distillation teacher in a Ray actor of its own (`distill.placement: actor`): one device, or
CPUs, on any node or the one the recipe names. It scores the student's micro-batches under the
objective the learners train with (its temperature, its positions), once per step; the stage
puts the logprobs into its batch before the learners train.
"""

from __future__ import annotations

from typing import Any

from rlkit.accel import DeviceInfo
from rlkit.actors.calls import wait_all
from rlkit.actors.roles import Role, call
from rlkit.config import ModelConfig, RayConfig
from rlkit.learner.objective import MicroBatch, Objective

NAME = "the teacher"  # in fault messages


class TeacherWorker:
    """The teacher's model, frozen, in its actor's process."""

    def __init__(self, model: ModelConfig, device: str):
        from rlkit.accel import apply_env, configure_cpu_threads, detect
        from rlkit.console import name_worker_log
        from rlkit.learner.logprobs import Reference
        from rlkit.model.kernels import with_kernels
        from rlkit.model.load import load_frozen, resolve_dtype

        name_worker_log("teacher")
        info = detect(device)
        apply_env(info)
        if not info.is_accelerator:
            configure_cpu_threads()
        dtype = resolve_dtype(model.dtype, info.bf16 and info.is_accelerator)
        self.device = info.torch_device
        # frozen and scored as the learner's reference and teacher copies are
        self.teacher = Reference(None, "full", lambda: with_kernels(load_frozen(model, dtype, self.device),
                                                                    model.kernels, info.kind,
                                                                    "distill.teacher.kernels"))

    def ready(self) -> str:
        """The node this teacher runs on (its address), once its model is loaded."""
        import ray

        return ray.util.get_node_ip_address()

    def logprobs(self, micro_batches: list[MicroBatch], objective: Objective) -> list[Any]:
        """Token logprobs [b, l-1] (CPU) of each micro-batch at `objective.temperature`, at the
        positions the objective reads (`objective.positions`; 0 elsewhere)."""
        out = []
        for mb in micro_batches:
            mb = mb.to(self.device)
            out.append(self.teacher.logprobs(mb, objective.temperature, objective.positions(mb)).cpu())
        return out


class TeacherActor:
    """The driver's handle on a `TeacherWorker` started on `node` (an address; None: where Ray finds room)."""

    def __init__(self, model: ModelConfig, device: DeviceInfo, ray_cfg: RayConfig, node: str | None = None):
        self.actor = Role.of(TeacherWorker, "teacher", device, ray_cfg).start(model, device.kind, name=NAME, node=node)
        self.node = wait_all([call(self.actor, TeacherWorker.ready)], [NAME], "its start")[0]

    def score(self, micro_batches: list[MicroBatch], objective: Objective) -> list[Any]:
        """`TeacherWorker.logprobs` of `micro_batches` (one call for all)."""
        return wait_all([call(self.actor, TeacherWorker.logprobs, micro_batches, objective)], [NAME], "scoring")[0]

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)
