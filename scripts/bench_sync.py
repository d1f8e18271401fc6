"""Weight sync, seconds per GB, against a memcpy of the same bytes: the learner's policy pushed into a
running vLLM engine by each transport this host can run.

    python scripts/bench_sync.py                       # SmolLM2-135M (513 MiB fp32), 5 pushes a transport
    python scripts/bench_sync.py --model 25m --repeat 3

Transports (`--transports`): object_store (a Ray actor holding a vLLM engine; the buckets go through
the object store), in_process (the engine in the pushing process, as `rollout.colocate: true`).
The broadcast transport needs NCCL between two devices and is not run on a CPU host.

What is timed: `push(iter_named_weights(model))` from a model in this process (fp32, as a full
fine-tuning learner's at ZeRO-0), each push whole (the bucketing, the transfer, the engines'
loads and their cache reset), after one untimed push; memcpy is a copy of one buffer of the same
bytes into another. Printed: median, min and max seconds and seconds per GB (1e9 bytes) per
transport, and the ratio to memcpy's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import SPREAD_HEADER, machine, run_spawned, spread, spread_cells  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an in-process engine: no engine-core process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, 25m, tiny or an HF model folder")
    p.add_argument("--repeat", type=int, default=5, help="timed pushes per transport")
    p.add_argument("--bucket-mib", type=float, default=256.0, help="rollout.sync_bucket_mib")
    p.add_argument("--transports", default="object_store,in_process")
    p.add_argument("--workdir", default=None)
    return p.parse_args(argv)


def _model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _named(model: Any) -> Any:
    from rlkit.learner.weights import iter_named_weights

    return iter_named_weights(model)


def _timed_pushes(sync: Any, model: Any, repeat: int) -> dict[str, Any]:
    sync.push(_named(model))
    times, size = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        stats = sync.push(_named(model))
        times.append(time.perf_counter() - t)
        size = stats.bytes
    return {"seconds": times, "bytes": size, "buckets": stats.buckets, "tensors": stats.tensors}


def phase_object_store(path: str, repeat: int, bucket_mib: float) -> dict[str, Any]:
    import ray

    from rlkit.rollout.worker import create_rollout_actor
    from rlkit.sync.weight_sync import ObjectStoreSync, SyncTarget

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = create_rollout_actor(path, num_cpus=1, dtype="float32", max_model_len=256, kv_cache_gib=0.25)
        ray.get(engine.ready.remote())
        model = _model(path)
        return _timed_pushes(ObjectStoreSync.open(SyncTarget([engine], bucket_mib)), model, repeat)
    finally:
        ray.shutdown()


def phase_in_process(path: str, repeat: int, bucket_mib: float) -> dict[str, Any]:
    from rlkit.rollout.worker import RolloutWorker
    from rlkit.sync.weight_sync import InProcessSync

    worker = RolloutWorker(path, dtype="float32", max_model_len=256, kv_cache_gib=0.25)
    return _timed_pushes(InProcessSync(worker, bucket_mib), _model(path), repeat)


def phase_memcpy(nbytes: int, repeat: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return {"seconds": times, "bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_learner import model_dir

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-sync-")
    work = Path(args.workdir or tmp.name)
    try:
        path = str(model_dir(args.model, work, 0))
        phases = {"object_store": phase_object_store, "in_process": phase_in_process}
        results = {name: run_spawned(phases[name], path, args.repeat, args.bucket_mib)
                   for name in args.transports.split(",")}
        first = next(iter(results.values()))
        nbytes = first["bytes"]
        results = {"memcpy": run_spawned(phase_memcpy, nbytes, max(args.repeat, 5)), **results}
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"model {args.model}: {nbytes / 2**20:.0f} MiB in {first['tensors']} "
          f"tensors, buckets of {args.bucket_mib:.0f} MiB; {machine()}; {args.repeat} timed pushes a transport")
    base = spread(results["memcpy"]["seconds"])["median"]
    print(f"{'transport':<14}{SPREAD_HEADER}{'s/GB':>8}{'/ memcpy':>10}{'buckets':>9}")
    for name, r in results.items():
        s = spread(r["seconds"])
        print(f"{name:<14}{spread_cells(s)}{s['median'] / (nbytes / 1e9):>8.3f}{s['median'] / base:>9.1f}x"
              f"{r.get('buckets', '-'):>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
