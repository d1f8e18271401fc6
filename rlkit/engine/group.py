"""Ray plumbing: start/attach Ray, place learner actors, call every rank at once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rlkit.accel import DeviceInfo
from rlkit.config import RayConfig

# Variables every actor gets (vLLM reads VLLM_* at import; one OpenMP thread per process on CPU).
WORKER_ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR",
                   "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")


def worker_env(device: DeviceInfo, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Ray actors: the device layer's advice, VLLM_* and pass-through variables."""
    env = dict(device.env)
    env.update({k: v for k, v in os.environ.items() if k in WORKER_ENV_KEYS or k.startswith("VLLM_")})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def start_ray(cfg: RayConfig, device: DeviceInfo) -> bool:
    """Attach to `cfg.address` or start a local instance. Returns True if rlkit started it."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": worker_env(device)}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=env, log_to_driver=True)
        return False
    num_cpus = cfg.num_cpus or max(os.cpu_count() or 1, 4)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True,
             configure_logging=True, logging_level="WARNING")
    return True


def actor_resources(device: DeviceInfo, cpus: float, devices: int = 1) -> dict[str, Any]:
    """`options(...)` for one actor that owns `devices` devices (or only CPUs)."""
    opts: dict[str, Any] = {"num_cpus": cpus}
    if device.ray_resource == "GPU":
        opts["num_gpus"] = devices
    elif device.ray_resource:
        opts["resources"] = {device.ray_resource: devices}
    return opts


def placement_group(device: DeviceInfo, n: int, cpus: float, strategy: str = "PACK", devices: int = 1):
    """A ready placement group of `n` bundles, `devices` devices (or only CPUs) each."""
    import ray
    from ray.util.placement_group import placement_group as make_pg

    bundle: dict[str, float] = {"CPU": cpus}
    if device.ray_resource:
        bundle[device.ray_resource] = devices
    pg = make_pg([bundle] * n, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not place {n} actors with {bundle} each within 120 s: "
                           f"cluster has {ray.cluster_resources()}") from None
    return pg


class LearnerGroup:
    """`num` Learner actors forming one torch.distributed group; `call` runs a method on all ranks."""

    def __init__(self, spec: Any, num: int, device: DeviceInfo, ray_cfg: RayConfig, pg=None, bundle_offset: int = 0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.engine.learner import Learner

        self.pg = pg or placement_group(device, num, ray_cfg.cpus_per_actor)
        opts = actor_resources(device, ray_cfg.cpus_per_actor)
        remote = ray.remote(Learner)
        self.actors = [
            remote.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle_offset + rank),
                runtime_env={"env_vars": worker_env(device)}).remote(spec, rank, num)
            for rank in range(num)
        ]
        addr, port = ray.get(self.actors[0].address.remote())
        self.call("init_process_group", addr, port)
        self.info = self.call("build")[0]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method(*args)` on every rank; returns the per-rank results."""
        import ray

        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_each(self, method: str, per_rank_args: Sequence[tuple]) -> list[Any]:
        """Run `method(*per_rank_args[r])` on rank r (for sharded batches)."""
        import ray

        return ray.get([getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)])

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        ray.util.remove_placement_group(self.pg)
