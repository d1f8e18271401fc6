"""Cost of the code reward per sample and per test case: this checkout against an earlier one.

    OMP_NUM_THREADS=1 python scripts/bench_code_reward.py [--baseline REV] [--samples 64] [--repeat 5]

Scores a GRPO-sized batch (``--samples`` completions of 8 prompts, MBPP-style assert tests and
stdin/stdout tests, half of the completions right) with ``rewards.code:code_reward`` as this
checkout has it and as ``--baseline`` (a git revision: its ``rlkit`` and ``rewards``, exported
from git) had it, each side in a process of its own, alternating, ``--repeat`` batches each after
a warm-up batch, and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOOD = "def f(xs):\n    return sorted(set(xs))[:{k}]\n"
BAD = "def f(xs):\n    return list(xs)[:{k}]\n"
STDIO_GOOD = "xs = list(map(int, input().split()))\nprint(sum(xs) * {k})\n"
STDIO_BAD = "xs = input()\nprint(len(xs) * {k})\n"


def batch(samples: int) -> tuple[list[str], list[list]]:
    """``samples`` fenced completions over 8 prompts (4 assert, 4 stdio), 5 tests each."""
    completions, tests = [], []
    for i in range(samples):
        p, right = i % 8, (i // 8) % 2 == 0
        if p < 4:
            code = (GOOD if right else BAD).format(k=p + 2)
            cases = [f"assert f({[j, 3, j, 1, 2]!r}) == {sorted({j, 3, 1, 2})[:p + 2]!r}" for j in range(5)]
        else:
            code = (STDIO_GOOD if right else STDIO_BAD).format(k=p)
            cases = [{"input": f"{j} 2 3", "output": str((j + 5) * p)} for j in range(5)]
        completions.append(f"```python\n{code}```")
        tests.append(cases)
    return completions, tests


def export(rev: str) -> Path:
    """``rlkit`` and ``rewards`` as ``rev`` had them, in a folder of their own."""
    out = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "rlkit", "rewards"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def one_side(tree: Path, samples: int, workers: int, batches: int) -> tuple[list[float], float]:
    """``batches`` timed batches (after a warm-up) of the code reward in ``tree``, in a fresh process:
    the seconds of each, and the mean score."""
    prog = (f"import json, sys, time\nsys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT)!r})\n"
            "from rewards.code import code_reward\nfrom scripts.bench_code_reward import batch\n"
            f"c, t = batch({samples})\ncode_reward(c, t, workers={workers})\nts = []\n"
            f"for _ in range({batches}):\n    t0 = time.perf_counter(); s = code_reward(c, t, workers={workers})\n"
            "    ts.append(time.perf_counter() - t0)\nprint(json.dumps([ts, sum(s) / len(s)]))")
    out = subprocess.run([sys.executable, "-c", prog], check=True, capture_output=True, text=True, cwd=tree)
    ts, score = json.loads(out.stdout.strip().splitlines()[-1])
    return ts, score  # (rewards.code is imported before this script, which puts the checkout first on the path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="93cf511", help="git revision to compare with (default: 93cf511, the "
                                                          "judge that split each assert and ran its sides)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    completions, tests = batch(args.samples)
    cases = sum(len(t) for t in tests)
    sides = {"current": ROOT, f"baseline {args.baseline}": export(args.baseline)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    scores = {}
    for _ in range(args.repeat):  # alternating: one timed batch of each side per round
        for name, tree in sides.items():
            ts, scores[name] = one_side(tree, args.samples, args.workers, 1)
            times[name] += ts
    print(f"{args.samples} samples, {cases} test cases, {args.workers} workers, median of {args.repeat} batches")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<20} {med:7.3f} s a batch (min {min(ts):.3f}, max {max(ts):.3f}): "
              f"{1000 * med / args.samples:6.1f} ms a sample, {1000 * med / cases:5.2f} ms a test case; "
              f"mean score {scores[name]:.3f}")
    base, cur = (statistics.median(times[k]) for k in (f"baseline {args.baseline}", "current"))
    print(f"current / baseline: {cur / base:.2f}x the time")


if __name__ == "__main__":
    main()
