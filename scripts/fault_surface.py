"""Seconds from `kill -9` of one learner to the end of `rlkit grpo` (the line it ends with), and
of one rollout engine to the run going on with a restarted engine (issue 11: the time a death
takes to surface, and to recover from).

    python scripts/fault_surface.py --model runs/tiny-sft/final --data runs/tiny/data --repeats 3

Runs `recipes/tiny-grpo.yaml` (2 learners, 2 engines) from `--model`, kills one actor process
of the target (`ray::Learner`, `ray::RolloutWorker`; not a process it forked) one second after
step 3 is logged, and prints each run's seconds and the median: for a learner until the run exits,
for an engine until the run logs the restart (the run then finishes its steps; its exit code is
printed too). A kill that lands after the engines' last call restarts nothing and is not counted.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


RESTART = re.compile(r"; restarted (and re-synced )?in [0-9.]+ s")


def surface(model: str, data: str, target: str, out: Path) -> tuple[float | None, int, str]:
    """Seconds from the kill to the exit (learner) or to the restart's line (engine; None when the
    run ended without one: the kill came after the engine's last call), the exit code, and the
    line the run ended with (for an engine, its restart line)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["rlkit", "grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), f"model.path={model}",
           f"data.train={data}/grpo_train.jsonl", f"data.eval={data}/grpo_eval.jsonl",
           "data.build_synthetic_if_missing=null",
           f"output_dir={out}", "logging.progress=none", "logging.tensorboard=false",
           f"grpo.steps={20 if target == 'Learner' else 12}",
           "eval.every=0", "checkpoint.every=2"]
    err = out.with_suffix(".err")
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env={**os.environ, "OMP_NUM_THREADS": "1"})
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"reward/mean"') >= 3):
            if proc.poll() is not None:
                raise SystemExit(f"the run ended before the kill: see {err}")
            time.sleep(0.1)
        ps = [line.split(None, 2) for line in
              subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]]
        actors = {int(pid): int(ppid) for pid, ppid, args in ps if f"ray::{target}" in args}
        # the actors themselves, not a process one of them forked (it carries the same name)
        pids = sorted(pid for pid, ppid in actors.items() if ppid not in actors)
        time.sleep(1.0)  # into the next step
        t0 = time.monotonic()
        os.kill(pids[-1], signal.SIGKILL)
        if target == "Learner":
            code = proc.wait()
            seconds = time.monotonic() - t0
        else:
            while not RESTART.search(err.read_text()) and proc.poll() is None:
                time.sleep(0.05)
            seconds = time.monotonic() - t0 if RESTART.search(err.read_text()) else None
            code = proc.wait()
    lines = err.read_text().strip().splitlines()
    return seconds, code, next((x for x in lines if RESTART.search(x)), lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GRPO start model (e.g. runs/tiny-sft/final)")
    parser.add_argument("--data", required=True, help="folder with grpo_train.jsonl and grpo_eval.jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    targets = ["Learner", "RolloutWorker"]
    parser.add_argument("--targets", nargs="+", default=targets, choices=targets, help="what to kill (default both)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fault-surface-"))
    for target in args.targets:
        times = []
        for i in range(args.repeats):
            seconds, code, last = surface(args.model, args.data, target, work / f"{target}-{i}")
            if seconds is None:
                print(f"{target} killed after its last call: no restart (exit {code}); not counted")
                continue
            times.append(seconds)
            print(f"{target} killed: {'exit' if target == 'Learner' else 'restarted'} after {seconds:.2f} s "
                  f"(exit {code}): {last[:200]}")
        if times:
            print(f"{target}: median {statistics.median(times):.2f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
