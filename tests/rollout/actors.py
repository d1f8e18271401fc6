"""One rollout engine as a Ray actor of its own, anywhere in the cluster, for the engine tests (a run's
engines are placed by `rlkit.rollout.separate.SeparateEngines`)."""

from __future__ import annotations

from typing import Any

from rlkit.rollout.worker import RolloutWorker, cpu_engine_env


def create_rollout_actor(model: str, *, num_cpus: float = 1, resources: dict[str, float] | None = None,
                         env_vars: dict[str, str] | None = None, name: str = "engine",
                         accelerator: bool | None = None, **worker_kwargs: Any) -> Any:
    """A `RolloutWorker` in a Ray actor of its own, anywhere in the cluster (a run's are placed
    by `SeparateEngines`). `resources` as Ray counts them (`{"GPU": 1}`, `{"NPU": 1}`);
    `env_vars` are added to `cpu_engine_env()` on a CPU engine (`accelerator` False; None: any
    resource besides CPUs means an accelerator). `worker_kwargs` go to `RolloutWorker`."""
    from rlkit.actors.roles import Role

    resources = dict(resources or {})
    num_gpus = resources.pop("GPU", 0)
    num_cpus = resources.pop("CPU", num_cpus)
    if accelerator is None:
        accelerator = bool(num_gpus or resources)
    env = {} if accelerator else cpu_engine_env(worker_kwargs.get("kv_cache_gib"))
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources)
    return Role(RolloutWorker, options, {**env, **(env_vars or {})}).start(model, name=name, **worker_kwargs)
