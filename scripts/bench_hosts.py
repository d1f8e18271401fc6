"""The tiny GRPO recipe on one host against the same run with its learners on two hosts (issue 12):
median step time, training time and weight-sync time, and the sync's seconds per GiB.

    python scripts/bench_hosts.py --model runs/tiny-sft/final --data runs/tiny/data --steps 12 --repeat 2

Both sides run `recipes/tiny-grpo.yaml` with 2 learners (ZeRO-2) and 1 engine. One host: a
local Ray instance (the idle two-host cluster stays up meanwhile). Two hosts: the namespace
cluster of the tests (`tests/cluster.py`; root only; `ray.placement=strict_spread`), a learner on
each host and the engine on host B, so the gradients' allreduce and the weight sync from learner
rank 0 may cross hosts (the allreduce always does). The hosts are network namespaces joined by
veth pairs on this machine: the figures are what crossing a TCP link costs rlkit's protocol
(gloo, Ray's object transfer), not a real network's bandwidth. Steps 1-2 (start-up) are not
timed; the rounds alternate which side runs first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import SPREAD_HEADER, machine, spread, spread_cells  # noqa: E402

from tests.cluster import NetnsCluster  # noqa: E402

KEYS = ("time/step", "time/train", "time/sync", "sync/s_per_gib")


def run(cluster: NetnsCluster | None, model: str, data: str, steps: int, out: Path) -> dict[str, list[float]]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rlkit.cli", "grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), f"model.path={model}",
           f"data.train={data}/grpo_train.jsonl", f"data.eval={data}/grpo_eval.jsonl",
           "data.build_synthetic_if_missing=null", f"output_dir={out}", f"grpo.steps={steps}", "eval.every=0",
           "checkpoint.every=0", "rollout.num_engines=1", "logging.progress=none",
           "logging.tensorboard=false", "rollout.sync_check_every=0"]
    if cluster is None:  # a local Ray instance, both learners and the engine on this host
        res = subprocess.run([*cmd, "ray.placement=pack"], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        res = cluster.run(0, [*cmd, "ray.placement=strict_spread", "--address", cluster.head], cwd=ROOT,
                          timeout=1200)
    if res.returncode:
        raise SystemExit(f"{'two hosts' if cluster else 'one host'}: rlkit grpo failed: {res.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in rows if "reward/mean" in r and r["step"] > 2]
    return {k: [r[k] for r in timed if k in r] for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an SFT-trained tiny model (rlkit sft recipes/tiny-sft.yaml)")
    p.add_argument("--data", required=True, help="the task data folder (grpo_train.jsonl, grpo_eval.jsonl)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    why = NetnsCluster.available()
    if why:
        raise SystemExit(f"no test hosts here: {why}")
    model, data = str(Path(a.model).resolve()), str(Path(a.data).resolve())
    pooled: dict[str, dict[str, list[float]]] = {"one host": {k: [] for k in KEYS}, "two hosts": {k: [] for k in KEYS}}
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    cluster = NetnsCluster(hosts=2, cpus=[1, 2]).start()
    try:
        for r in range(a.repeat):
            order = ["one host", "two hosts"] if r % 2 == 0 else ["two hosts", "one host"]
            for side in order:
                got = run(cluster if side == "two hosts" else None, model, data, a.steps, work / f"{side}-{r}")
                for k in KEYS:
                    pooled[side][k] += got[k]
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {machine()}; tiny GRPO, 2 learners (ZeRO-2, strict_spread) + 1 engine, {a.steps} steps, "
          f"steps 3-{a.steps} timed, {a.repeat} rounds")
    print(f"{'':16s} one host {SPREAD_HEADER} | two hosts {SPREAD_HEADER}")
    for k in KEYS:
        one, two = spread(pooled["one host"][k]), spread(pooled["two hosts"][k])
        print(f"{k:16s} one host {spread_cells(one)} | two hosts {spread_cells(two)} | "
              f"ratio {two['median'] / one['median']:.2f}")
    gap = statistics.median(pooled["two hosts"]["time/step"]) - statistics.median(pooled["one host"]["time/step"])
    print(f"two hosts add {gap:+.3f} s per step (median against median)")


if __name__ == "__main__":
    main()
