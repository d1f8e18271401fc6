"""Ray plumbing: start or join Ray, environment for actors, placement groups and actor resources.

Learners (`group.py`) and rollout engines (`engines.py`) are placed through these.
"""

from __future__ import annotations

import os
from pathlib import Path
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


def start_ray(cfg: RayConfig, device: DeviceInfo, log_dir: Path | None = None) -> bool:
    """Attach to `cfg.address` or start a local instance. Returns True if rlkit started it.
    With a quiet console (the CLI, see `rlkit.console`) the actors' output goes to `log_dir`."""
    import ray

    from rlkit import console

    if ray.is_initialized():
        return False
    quiet = console.quiet() and log_dir is not None
    if quiet:
        console.quiet_driver()  # the console handler `import ray` added
    logs = console.worker_runtime_env(log_dir) if quiet else {}
    env = {**logs, "env_vars": {**worker_env(device), **logs.get("env_vars", {})}}
    common = dict(runtime_env=env, log_to_driver=not quiet, configure_logging=not quiet, logging_level="WARNING")
    if cfg.address:
        ray.init(address=cfg.address, **common)
    else:
        ray.init(num_cpus=cfg.num_cpus or max(os.cpu_count() or 1, 4), include_dashboard=False, **common)
    if quiet:
        console.quiet_driver()  # what Ray's start added
    return not cfg.address


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
