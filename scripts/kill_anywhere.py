"""Kill the whole run anywhere, resume it, and compare with a run never killed (issue 11).

    python scripts/kill_anywhere.py --model runs/tiny-sft/final --data runs/tiny/data --points 12

For SFT (`recipes/tiny-sft.yaml`, 16 steps from the tiny model, checkpoint every 4) and for
synchronous GRPO (`recipes/tiny-grpo.yaml` from `--model`, 8 steps, one engine, one ZeRO-2
learner, checkpoint every 2), it runs each once undisturbed (beside the first killed run: they
share nothing but the machine, and both are seeded), and `--points` times more
(shared out over the stages) with a kill -9 of the driver's process group, which holds Ray's
local services, so every process of the run goes at once, as when a node is lost. The kill
points cycle through the phases below, with the step drawn at random (`--seed`):
- step: the driver has logged a step and not yet written its checkpoint;
- checkpoint: mid-checkpoint: the learners' files are written, the manifest is not;
- train_step / fit: a learner is in the middle of a training step;
- save_checkpoint: a learner has started writing its checkpoint files;
- weight_sync: the engine is loading the new weights (mid-sync);
- generate: the engine is generating;
- time: at a random moment of the run (an outside kill, no hook).
Each killed run is then rerun with the same command (it resumes from its newest intact
checkpoint, or starts over without one) and must end with the same per-step losses (SFT) or
rewards (GRPO) and bit-identical final weights. Prints one line per kill point and the count;
exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = {  # the kill points of each stage, in the order they are used: (phase, actor, calls in one run)
    "sft": [("checkpoint", "driver", 4), ("train_step", "learner0", 16), ("step", "driver", 16),
            ("time", "", 0), ("save_checkpoint", "learner0", 4)],
    "grpo": [("weight_sync", "engine0", 8), ("checkpoint", "driver", 4), ("generate", "engine0", 11),
             ("step", "driver", 8), ("fit", "learner0", 8), ("time", "", 0)],
}
MARK = "RLKIT_KILL_ANYWHERE"  # in the environment of every process of one run (also Ray's)


def command(stage: str, out: Path, model: str, data: Path, work: Path) -> list[str]:
    common = [f"output_dir={out}", "logging.progress=none", "logging.tensorboard=false",
              "data.build_synthetic_if_missing=null"]
    if stage == "sft":
        return [sys.executable, "-m", "rlkit.cli", "sft", str(ROOT / "recipes" / "tiny-sft.yaml"), *common,
                f"model.path={work / 'tiny' / 'model'}", f"data.train={data / 'sft_train.jsonl'}",
                f"data.eval={data / 'sft_eval.jsonl'}", "train.max_steps=16", "checkpoint.every=4", "eval.every=8"]
    return [sys.executable, "-m", "rlkit.cli", "grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), *common,
            f"model.path={model}", f"data.train={data / 'grpo_train.jsonl'}", f"data.eval={data / 'grpo_eval.jsonl'}",
            "grpo.steps=8", "checkpoint.every=2", "eval.every=4", "rollout.num_engines=1", "grpo.num_learners=1",
            "grpo.max_staleness=0"]


def run(cmd: list[str], tag: str, log: Path, fault: str = "", kill_after: float | None = None) -> int:
    """Run `cmd` in its own process group; `fault`: RLKIT_FAULT; `kill_after`: seconds after which
    the group is killed from outside. Waits until no process of the run is left."""
    env = {**os.environ, MARK: tag, "OMP_NUM_THREADS": "1", "RLKIT_FAULT": fault}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    deadline = time.time() + 30
    while _processes(tag) and time.time() < deadline:
        time.sleep(0.5)
    for pid in _processes(tag):  # Ray workers exit when their raylet dies; any straggler goes too
        os.kill(pid, signal.SIGKILL)
    return code


def _processes(tag: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"{MARK}={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            pass
    return found


def reference(stage: str, cmd: list[str], out: Path, key: str, work: Path) -> tuple[float, dict[int, float]]:
    """The undisturbed run (its seconds, `key` per step); it says so in one line."""
    t0 = time.monotonic()
    if run(cmd, f"{stage}-ref", work / f"{stage}-ref.err") != 0:
        raise SystemExit(f"the undisturbed {stage} run failed: see {work / f'{stage}-ref.err'}")
    seconds, want = time.monotonic() - t0, per_step(out, key)
    print(f"{stage}: undisturbed run {seconds:.0f} s, {key} per step {[round(v, 4) for v in want.values()]}",
          flush=True)
    return seconds, want


def per_step(out: Path, key: str) -> dict[int, float]:
    """`key` of each step in `metrics.jsonl` (the last record of a step logged twice)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r[key] for r in rows if key in r}


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def landed(out: Path, key: str) -> str:
    """Where a kill landed: the last step logged, the checkpoints whole and half-written."""
    ckpts = out / "checkpoints"
    whole = sorted(p.name for p in ckpts.glob("step-*")) if ckpts.exists() else []
    half = sorted(p.name for p in ckpts.glob(".*")) if ckpts.exists() else []
    steps = per_step(out, key) if (out / "metrics.jsonl").exists() else {}
    return (f"after step {max(steps, default=0)} was logged; checkpoints {', '.join(whole) or 'none'}"
            + (f"; half-written {', '.join(half)}" if half else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GRPO start model (e.g. runs/tiny-sft/final)")
    parser.add_argument("--data", required=True, help="folder with sft_*.jsonl and grpo_*.jsonl (runs/tiny/data)")
    parser.add_argument("--points", type=int, default=12, help="kill points, shared out over the stages")
    parser.add_argument("--stages", nargs="+", default=["sft", "grpo"], choices=["sft", "grpo"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", help="folder for the runs (default: a new temporary folder)")
    args = parser.parse_args()
    rng, data = random.Random(args.seed), Path(args.data).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="kill-anywhere-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shares = [args.points // len(args.stages) + (i < args.points % len(args.stages)) for i in range(len(args.stages))]
    results = []
    pool = ThreadPoolExecutor(1)
    for stage, share in zip(args.stages, shares):
        key = "train/loss" if stage == "sft" else "reward/mean"
        ref = work / f"{stage}-ref"
        # the undisturbed run goes on beside the first killed one (they share nothing but the machine)
        undisturbed = pool.submit(reference, stage, command(stage, ref, args.model, data, work), ref, key, work)
        for n in range(share):
            phase, actor, calls = PHASES[stage][n % len(PHASES[stage])]
            out, tag = work / f"{stage}-{n}", f"{stage}-{n}"
            cmd = command(stage, out, args.model, data, work)
            if phase == "time":
                seconds, _ = undisturbed.result()  # a moment of the run: its length first
                at = rng.uniform(0.2, 0.9) * seconds
                point, code = f"at {at:.1f} s", run(cmd, tag, work / f"{tag}.err", kill_after=at)
            else:
                after = rng.randrange(calls)
                point = f"halt:{phase}:{actor}:{after}"
                code = run(cmd, tag, work / f"{tag}.err", fault=point)
            if code == 0:
                print(f"{stage} {point}: the run ended before the kill; not counted", flush=True)
                continue
            where = landed(out, key)
            rerun = run(cmd, f"{tag}-resume", work / f"{tag}-resume.err")
            text = (work / f"{tag}-resume.err").read_text()
            resumed = re.search(r"resumed from \S+ \(step (\d+)\)", text)
            _, want = undisturbed.result()
            ok = rerun == 0 and per_step(out, key) == want and same_weights(ref, out)
            results.append((stage, ok))
            again = f"resumed at step {resumed[1]}" if resumed else "started over"
            print(f"{stage} {point}: killed (exit {code}) {where}; the rerun {again}, exit {rerun}: "
                  f"{'bit-identical' if ok else 'DIFFERENT'}", flush=True)
        undisturbed.result()  # printed, and failed loudly if it failed, even when no kill point used it
    same = sum(ok for _, ok in results)
    by_stage = ", ".join(f"{s} {sum(ok for t, ok in results if t == s)}/{sum(t == s for t, _ in results)}"
                         for s in args.stages)
    print(f"kill anywhere: {len(results)} kill points, {same} resumed bit-identically ({by_stage})")
    sys.exit(0 if same == len(results) and results else 1)


if __name__ == "__main__":
    main()
