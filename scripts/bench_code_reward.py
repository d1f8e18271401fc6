"""Cost of the code reward per sample and per test case: this checkout against an earlier one.

    OMP_NUM_THREADS=1 python scripts/bench_code_reward.py [--baseline REV] [--samples 64] [--repeat 5]

Scores a GRPO-sized batch (``--samples`` completions of 8 prompts, MBPP-style assert tests and
stdin/stdout tests, half of the completions right) with ``rewards.code:code_reward`` as this
checkout has it and as ``--baseline`` (a git revision; its ``rewards/code.py`` is loaded from
git) had it, alternating, ``--repeat`` times each, and prints the medians and their ratio. The
first batch of each side is a warm-up (the judge's cache of a test list's own values starts
empty, as in a run's first step).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def load_baseline(rev: str):
    """``rewards/code.py`` as ``rev`` had it, imported as its own module."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:rewards/code.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "code_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("code_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["code_baseline"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="bfe725f", help="git revision to compare with (default: bfe725f, the "
                                                          "sandbox before the judge moved out and bubblewrap came in)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from rewards import code as current

    baseline = load_baseline(args.baseline)
    completions, tests = batch(args.samples)
    cases = sum(len(t) for t in tests)
    sides = {"current": current.code_reward, f"baseline {args.baseline}": baseline.code_reward}
    times: dict[str, list[float]] = {k: [] for k in sides}
    scores = {}
    for rep in range(args.repeat + 1):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            scores[name] = fn(completions, tests, workers=args.workers)
            if rep:
                times[name].append(time.perf_counter() - t0)
    print(f"{args.samples} samples, {cases} test cases, {args.workers} workers, median of {args.repeat} batches")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<20} {med:7.3f} s a batch (min {min(ts):.3f}, max {max(ts):.3f}): "
              f"{1000 * med / args.samples:6.1f} ms a sample, {1000 * med / cases:5.2f} ms a test case; "
              f"mean score {sum(scores[name]) / len(scores[name]):.3f}")
    base, cur = (statistics.median(times[k]) for k in (f"baseline {args.baseline}", "current"))
    print(f"current / baseline: {cur / base:.2f}x the time")


if __name__ == "__main__":
    main()
