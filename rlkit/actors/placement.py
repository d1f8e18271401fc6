"""Ray plumbing: start or join Ray, environment for actors, placement groups and actor resources.

Learners (`group.py`) and rollout engines (`engines.py`) are placed through these.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.accel import CPU_KERNEL_CACHE_ENV, CPU_MALLOC_ENV, DeviceInfo
from rlkit.actors import reaper
from rlkit.config import RayConfig
from rlkit.errors import UserError

# Variables every actor gets (vLLM reads VLLM_* at import; one OpenMP thread per process on CPU).
WORKER_ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR",
                   "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH", *CPU_MALLOC_ENV, *CPU_KERNEL_CACHE_ENV)


def worker_env(device: DeviceInfo, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Ray actors: the device layer's advice, VLLM_* and pass-through variables."""
    env = dict(device.env)
    env.update({k: v for k, v in os.environ.items() if k in WORKER_ENV_KEYS or k.startswith("VLLM_")})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def start_ray(cfg: RayConfig, device: DeviceInfo, log_dir: Path | None = None) -> bool:
    """Attach to `cfg.address` or start a local instance (watched: `stop_ray`). Returns True if
    rlkit started it. With a quiet console (the CLI, see `rlkit.console`) the actors' output goes to `log_dir`."""
    import ray

    from rlkit import console

    if ray.is_initialized():
        return False
    quiet = console.quiet() and log_dir is not None
    if quiet:
        console.quiet_driver()  # the console handler `import ray` added
    logs = console.worker_runtime_env(log_dir) if quiet else {}
    env = _beside_job({**logs, "env_vars": {**worker_env(device), **logs.get("env_vars", {})}})
    common = dict(runtime_env=env, log_to_driver=not quiet, configure_logging=not quiet, logging_level="WARNING")
    # `ray job submit -- rlkit ...` runs rlkit on the head with RAY_ADDRESS set: that cluster
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError) as e:
            raise UserError(_join_error(address, e), "ray.address") from None
    else:
        global _STOP_WATCHER
        _STOP_WATCHER = reaper.watch()  # before Ray starts: its processes inherit the run's mark
        try:
            ray.init(num_cpus=cfg.num_cpus or max(os.cpu_count() or 1, 4), include_dashboard=False, **common)
        except BaseException:
            stop_ray()
            raise
    if quiet:
        console.quiet_driver()  # what Ray's start added
    return not address


_STOP_WATCHER: Callable[[], None] | None = None


def stop_ray() -> None:
    """Shut down the Ray instance `start_ray` started, then end whatever of it is still running
    (the watcher of `rlkit.actors.reaper`, which also does so if this process dies first)."""
    global _STOP_WATCHER
    import ray

    try:
        ray.shutdown()
    finally:
        stop, _STOP_WATCHER = _STOP_WATCHER, None
        if stop is not None:
            stop()


def _beside_job(env: dict[str, Any]) -> dict[str, Any]:
    """rlkit's runtime_env without what the Ray job it runs in already sets (`ray job submit
    --runtime-env-json`, `--working-dir`): Ray refuses a driver's runtime_env that sets the same
    field or variable as its job's, and the user's choice wins."""
    import json

    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    out = {k: v for k, v in env.items() if k == "env_vars" or k not in job}
    out["env_vars"] = {k: v for k, v in env.get("env_vars", {}).items() if k not in job.get("env_vars", {})}
    return out


def _join_error(address: str, error: BaseException) -> str:
    """One line for a cluster `ray.init(address=...)` could not join."""
    chain, cause = [], error
    while cause is not None and len(chain) < 8:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    text = " ".join(chain)
    if "AuthenticationError" in text or "InvalidAuthToken" in text:
        return (f"the Ray cluster at {address} uses token authentication and this process has not its token: "
                "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to a copy of the head node's token "
                "(~/.ray/auth_token there), or RAY_AUTH_TOKEN to the token itself")
    first = " ".join(str(error).split())[:200]
    return (f"could not join a Ray cluster at {address}: {first}. Start one there (`ray start --head`, see "
            "docs/clusters.md) or give the address `ray start` printed")


def actor_resources(device: DeviceInfo, cpus: float, devices: int = 1,
                    custom: dict[str, float] | None = None) -> dict[str, Any]:
    """`options(...)` for one actor that owns `devices` devices (or only CPUs) and the `custom`
    resources of its role (`ray.resources`)."""
    opts: dict[str, Any] = {"num_cpus": cpus}
    if device.ray_gpus:
        opts["num_gpus"] = devices
    elif device.ray_resource:
        opts["resources"] = {device.ray_resource: devices}
    if custom:
        opts["resources"] = {**opts.get("resources", {}), **custom}
    return opts


def bundle(device: DeviceInfo, cpus: float, devices: int = 1,
           custom: dict[str, float] | None = None) -> dict[str, float]:
    """One actor's placement-group bundle: `cpus` CPUs, `devices` devices (none on a CPU) and the
    `custom` resources of its role."""
    out: dict[str, float] = {"CPU": cpus}
    if device.ray_resource:
        out[device.ray_resource] = devices
    return {**out, **(custom or {})}


def engine_cpus(device: DeviceInfo, ray_cfg: RayConfig, tp: int) -> float:
    """CPUs of one rollout engine's bundle: vLLM on a CPU runs one process per TP rank."""
    return ray_cfg.cpus_per_actor * (1 if device.is_accelerator else tp)


def placement_group(device: DeviceInfo, n: int, cpus: float, placement: str = "pack", devices: int = 1,
                    custom: dict[str, float] | None = None):
    """A ready placement group of `n` bundles, `devices` devices (or only CPUs) and `custom`
    resources each, placed as `placement` (a `ray.placement` value) says."""
    import ray
    from ray.util.placement_group import placement_group as make_pg

    from rlkit.actors.cluster import STRATEGIES

    one = bundle(device, cpus, devices, custom)
    pg = make_pg([one] * n, strategy=STRATEGIES[placement])
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not place {n} actors with {one} each ({placement}) within 120 s: "
                           f"cluster has {ray.cluster_resources()}, available {ray.available_resources()}") from None
    return pg
