"""Held-out accuracy of the tiny GRPO demo by staleness and rollout correction (one table).

    python scripts/off_policy_table.py --out runs/off-policy [--staleness 0 1 2] [--seeds 0]
    python scripts/off_policy_table.py --out runs/stream --staleness 1 --corrections token_truncate \
        --seeds 0 1 --modes step stream     # streamed groups (grpo.streaming) against the step-level async run

Builds the tiny model, data and SFT start point as `rlkit demo` does (once, reused), then runs
`recipes/tiny-grpo.yaml` (40 steps, 2 engines + 2 learners) for each max_staleness, with the
default correction (token_truncate at 2) and with none, each in its own process. Prints the
held-out exact-answer accuracy after the last step (median over seeds), the mean sampler/learner
KL and the mean step time; each seed's final accuracy (the seed-to-seed spread). `--modes stream`
runs each max_staleness >= 1 with `grpo.streaming` as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _run(out: Path, base: Path, staleness: int, correction: str, seed: int, mode: str) -> dict[str, float]:
    run = out / f"k{staleness}-{correction}-s{seed}{'-stream' * (mode == 'stream')}"
    if not (run / "final").exists():
        cmd = [sys.executable, "-m", "rlkit.cli", "grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"),
               f"model.path={base / 'tiny-sft' / 'final'}", f"data.train={base / 'tiny' / 'data' / 'grpo_train.jsonl'}",
               f"data.eval={base / 'tiny' / 'data' / 'grpo_eval.jsonl'}", f"output_dir={run}", f"seed={seed}",
               f"grpo.max_staleness={staleness}", f"grpo.rollout_correction={correction}", "checkpoint.every=0",
               "logging.progress=none", "logging.tensorboard=false", f"grpo.streaming={mode == 'stream'}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"  {run.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = _metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    return {"start": evals[0], "final": evals[-1],
            "kl": statistics.mean(r["train/mismatch/kl"] for r in steps),
            "step_s": statistics.median(r["time/step"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/off-policy")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--corrections", nargs="+", default=["token_truncate", "none"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--modes", nargs="+", default=["step"], choices=["step", "stream"],
                    help="step: a generation per step (today's); stream: grpo.streaming (max_staleness >= 1)")
    args = ap.parse_args()
    from rlkit.commands.demo import run_demo

    out = Path(args.out)
    base = out / "base"
    if not (base / "tiny-sft" / "final").exists():
        for line in run_demo(base, ["sft"]):
            print(f"  {line}", file=sys.stderr)
    print("| generation | max_staleness | rollout_correction | held-out accuracy start -> final (median) | "
          "final per seed | mean mismatch KL | median step s |")
    print("|---|---|---|---|---|---|---|")
    for k in args.staleness:
        for corr in args.corrections:
            for mode in [m for m in args.modes if m == "step" or k >= 1]:
                res = [_run(out, base, k, corr, s, mode) for s in args.seeds]
                med = {key: statistics.median(r[key] for r in res) for key in res[0]}
                seeds = " / ".join(f"{r['final']:.3f}" for r in res)
                print(f"| {mode} | {k} | {corr} | {med['start']:.3f} -> {med['final']:.3f} | {seeds} | "
                      f"{med['kl']:.2e} | {med['step_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
