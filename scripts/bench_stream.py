"""Streamed groups with partial rollouts against step-level generation, on a long-tail workload.

    python scripts/bench_stream.py            # both workloads; sync, async, stream:1, stream:8; 2 rounds
    python scripts/bench_stream.py --workloads long-tail --repeat 1 --steps 6 --phases async,stream:8

Each phase is one `rlkit grpo` run (`run_grpo` in a fresh spawned process: its own Ray, engine and
learner), one vLLM-CPU engine and one DeepSpeed learner, the same model, prompts, seeds and settings;
only the generation differs:
  sync      grpo.max_staleness 0: generate a step's prompts, then train on them
  async     grpo.max_staleness 1: step k+1 is generated while step k trains (the baseline)
  stream:K  grpo.streaming with max_staleness K: the engine generates without pause, a step trains
            on the first groups done, weights load mid-generation (partial_kv: keep); a group
            whose oldest token is more than K versions old is not trained (`dropped`)

Workloads (rows of the synthetic arithmetic task, alpaca template, random-init model that almost
never emits eos, so each row's length is what it is given):
  long-tail  each row's `min_tokens` = `max_tokens` = --short for 90% of rows, --long for the other 10%
             (seeded): most samples end early, a few run to the limit
  even       every completion --even tokens (the demo's kind of workload)

Rounds alternate the phases' order. Per phase, over the timed steps of all rounds (the first
--warmup steps of each run left out): the median and the mean step time (a long-tail run's steps
differ: the mean holds the long ones), tokens/s (the completion tokens trained over the timed steps'
time, each round; the median of the rounds), the engine's median busy fraction
(`rollout/busy_fraction`), the median sync wait (`time/sync`), the mean completion length trained,
and for streaming the share of partial samples and the groups dropped as stale. The ratio is of
tokens/s against `async`'s, measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, machine, prepare, run_spawned, spread

prepare()
RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"


def overrides_of(phase: str) -> list[str]:
    """A phase's overrides: `sync`, `async[:K]` (K = max_staleness, default 1), `stream[:K]`."""
    kind, _, k = phase.partition(":")
    k = k or ("0" if kind == "sync" else "1")
    return [f"grpo.max_staleness={k}", *(["grpo.streaming=true"] if kind == "stream" else [])]

KEYS = ("time/step", "time/sync", "completion/len_mean", "rollout/busy_fraction")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny", help="rlkit.tiny model size (tiny, 25m)")
    p.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--short", type=int, default=16, help="long-tail: the length of 90%% of rows")
    p.add_argument("--long", type=int, default=256, help="long-tail: the length of the other 10%%")
    p.add_argument("--even", type=int, default=32, help="even: every completion's length")
    p.add_argument("--workloads", default="long-tail,even", help="comma list of: long-tail, even")
    p.add_argument("--phases", default="sync,async,stream:1,stream:8",
                   help="comma list of: sync, async[:K], stream[:K] (K: max_staleness, default 1)")
    p.add_argument("--repeat", type=int, default=2, help="rounds (fresh processes, alternating order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep model, data and runs here (default: a temp dir)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--set", action="append", default=[], help="one more recipe override for every phase")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    kinds = {x.partition(":")[0] for x in args.phases}
    if set(args.workloads) - {"long-tail", "even"} or kinds - {"sync", "async", "stream"} or "async" not in args.phases:
        p.error("--workloads: long-tail, even; --phases: sync, async[:K], stream[:K] (async, the baseline, included)")
    if not 1 <= args.warmup < args.steps:
        p.error(f"need 1 <= --warmup ({args.warmup}) < --steps ({args.steps})")
    return args


def workload(rows_path: Path, out: Path, kind: str, args: argparse.Namespace) -> tuple[Path, int]:
    """The GRPO prompts with each row's length set (`min_tokens` = `max_tokens`); the length cap."""
    rng = random.Random(args.seed)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    for row in rows:
        n = (args.long if rng.random() < 0.1 else args.short) if kind == "long-tail" else args.even
        row["min_tokens"] = row["max_tokens"] = n
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out, (args.long if kind == "long-tail" else args.even)


def phase(args: argparse.Namespace, model: str, data: str, cap: int, extra: list[str], out: str) -> dict[str, Any]:
    """One run; its per-step records."""
    from rlkit import stages
    from rlkit.grpo.run import run_grpo
    from rlkit.run.metrics import read_jsonl

    overrides = [
        f"output_dir={out}", f"seed={args.seed}", f"model.path={model}", "device=cpu", f"data.train={data}",
        "data.eval=null", "data.build_synthetic_if_missing=null", "curriculum.enabled=false",
        "rewards=[{fn: 'rewards.exact:number_close'}]", f"grpo.steps={args.steps}",
        f"grpo.prompts_per_step={args.prompts}", f"grpo.group_size={args.group}", "grpo.micro_batch_size=16",
        "grpo.num_learners=1", "grpo.beta=0.0", "rollout.num_engines=1", f"rollout.max_tokens={cap}",
        f"rollout.max_model_len={cap + 64}", "optim.lr=1e-5", "deepspeed.zero_stage=0", "eval.every=0",
        "checkpoint.every=0", "checkpoint.resume=never", "overwrite=true", "logging.tensorboard=false",
        "logging.progress=none", *extra, *args.set]
    run_grpo(stages.load("grpo", RECIPE, overrides))
    records = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "time/step" in r]
    return {"records": records}


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    timed = [r for run in runs for r in run["records"][args.warmup:]]
    samples = args.prompts * args.group
    rounds = [[r for r in run["records"][args.warmup:]] for run in runs]
    per_round = [sum(r["completion/len_mean"] * samples for r in rs) / sum(r["time/step"] for r in rs) for rs in rounds]
    out = {"step": spread([r["time/step"] for r in timed]), "tokens_per_s": spread(per_round),
           "step_mean": statistics.fmean(r["time/step"] for r in timed),
           "busy": statistics.median(r.get("rollout/busy_fraction", float("nan")) for r in timed),
           "sync": statistics.median(r["time/sync"] for r in timed),
           "len": statistics.fmean(r["completion/len_mean"] for r in timed)}
    last = [run["records"][-1] for run in runs]
    out["partial"] = statistics.fmean(r.get("stream/partial_frac", 0.0) for r in timed)
    out["dropped"] = statistics.fmean(r.get("stream/dropped_stale", 0.0) for r in last)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlkit.tiny import build_tiny_model, write_task_data

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlkit-bench-stream-"))
    model = work / f"model-{args.size}"
    if not (model / "config.json").exists():
        build_tiny_model(model, args.size, seed=args.seed)
    task = write_task_data(work / "data", seed=args.seed)
    print(f"# bench_stream: {machine()}; model {args.size}; {args.prompts} prompts x {args.group} a step, "
          f"{args.steps} steps ({args.warmup} warmup) x {args.repeat} rounds; OMP_NUM_THREADS "
          f"{os.environ['OMP_NUM_THREADS']}; 1 engine + 1 learner", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for kind in args.workloads:
        data, cap = workload(task["grpo_train"], work / f"{kind}.jsonl", kind, args)
        runs: dict[str, list] = {name: [] for name in args.phases}
        for round_ in range(args.repeat):
            order = args.phases if round_ % 2 == 0 else args.phases[::-1]
            for name in order:
                t0 = time.perf_counter()
                runs[name].append(run_spawned(phase, args, str(model), str(data), cap, overrides_of(name),
                                              str(work / f"run-{kind}-{name}-{round_}")))
                print(f"#   {kind} {name} round {round_ + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
        results[kind] = {name: summarise(r, args) for name, r in runs.items()}
        base = results[kind]["async"]
        print(f"\n{kind} ({'90% ' + str(args.short) + ' / 10% ' + str(args.long) if kind == 'long-tail' else args.even}"
              f" tokens; {base['step']['n']} timed steps each)")
        print(f"{'phase':<10}{'step s':>9}{'mean s':>8}{'tokens/s':>10}{'vs async':>10}{'busy':>7}{'sync s':>8}"
              f"{'len':>7}{'partial':>9}{'dropped':>9}")
        for name, res in results[kind].items():
            ratio = res["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
            print(f"{name:<10}{res['step']['median']:>9.3f}{res['step_mean']:>8.3f}{res['tokens_per_s']['median']:>10.0f}{ratio:>9.2f}x"
                  f"{res['busy']:>7.2f}{res['sync']:>8.3f}{res['len']:>7.1f}{res['partial']:>9.2f}"
                  f"{res['dropped']:>9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
