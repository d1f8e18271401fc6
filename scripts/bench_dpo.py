"""Throughput and peak memory of `rlkit dpo` and `rlkit rm` against TRL's `DPOTrainer` and
`RewardTrainer`: same model, pairs, batch, precision, loss.

    python scripts/bench_dpo.py                      # 25m model, 30 steps, 8 pairs a step, fp32, 2 runs a side
    python scripts/bench_dpo.py --size tiny --steps 4 --warmup 1 --micro-batch 4 --rows 32 --repeat 1

For each stage (dpo, dpo-pf, rm) both trainers run one after the other, `--repeat` times each in alternating
order; the script prints a table of tokens/s and peak memory, and the ratios rlkit / TRL.

What is compared
  model   `rlkit.tiny.build_tiny_model(size)`, random init, on CPU; a reward model is the same model
          with a one-label score head (`AutoModelForSequenceClassification`).
  data    alpaca preference pairs generated here: "add these numbers step by step" (1-14 terms,
          most rows short), the worked answer chosen over one with a step left out and a wrong
          total. rlkit reads them as `rlkit dpo` does (`load_pair_data`: its template, eos, each
          side cut to `--cutoff` keeping its start); TRL gets the very same token ids (its
          trainers are built on one text row, then given the tokenised pairs in their own
          layout: `prompt_ids` / `chosen_ids` / `rejected_ids` for DPO, each side's whole row
          for the reward model) in rlkit's step order (`train_sampling_strategy="sequential"`),
          so both sides see the same pairs at every step.
  batch   `--micro-batch` pairs a step (chosen and rejected rows in one forward), grad_accum 1,
          one learner; padded to the longest row on both sides, except dpo-pf's rlkit side
          (`dpo.padding_free`: the rows one after another in one row, each attending to itself;
          TRL 1.16's DPOTrainer turns its own `padding_free` off and pads).
  loss    DPO: TRL's sigmoid loss, beta 0.1, the reference a frozen copy scored every step (TRL:
          `precompute_ref_log_probs=False`, its default). RM: TRL's Bradley-Terry loss.
  optim   AdamW, same lr, weight decay 0, grad clip 1.0, cosine schedule with the same warm-up.

How it is counted
  tokens  real (non-pad) tokens of the step's chosen and rejected rows, prompts included.
  time    rlkit: the driver's `time/step` (sampling the batch to the learner's reply: collate, Ray
          call, the reference's forward, forward, backward, optimizer step). TRL: between the
          ends of consecutive optimizer steps (a callback), so data loading and its reference
          forward are in. Steps 1 .. `--warmup` are left out; start-up is excluded on both sides.
  memory  the peak resident memory of the process that trains: rlkit's learner actor
          (`memory/learner_peak_gib`), TRL's own process (run alone, spawned; `ru_maxrss`).
  The table gives the median, minimum and maximum of the per-step tokens/s over the timed steps
  of all runs of a side, the ratio of the medians, and each side's largest peak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_sft import bench_rows
from benchlib import machine, model_line, quiet, run_spawned, spread

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES = ("dpo", "dpo-pf", "rm")  # dpo-pf: rlkit's DPO with dpo.padding_free against TRL's DPO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="25m", help="rlkit.tiny model size (tiny, 25m)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="each side's precision")
    p.add_argument("--stages", default="dpo,dpo-pf,rm", help="comma list of: dpo, dpo-pf, rm")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (>= 1)")
    p.add_argument("--micro-batch", type=int, default=8, help="pairs per step (grad_accum 1)")
    p.add_argument("--cutoff", type=int, default=256, help="data.cutoff_len / TRL max_length")
    p.add_argument("--rows", type=int, default=512, help="pairs to generate")
    p.add_argument("--repeat", type=int, default=2, help="runs per side and stage (alternating order)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep model, data and runs here (default: a temp dir)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not args.stages or any(s not in STAGES for s in args.stages):
        p.error(f"--stages: choose from {', '.join(STAGES)}")
    if args.repeat < 1 or not 1 <= args.warmup < args.steps:
        p.error(f"need --repeat >= 1 and 1 <= --warmup ({args.warmup}) < --steps ({args.steps})")
    return args


def bench_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """`bench_sft.py`'s alpaca rows (k terms added step by step, most rows short) as ranking rows:
    the worked answer chosen over one that leaves out its last step and ends with a wrong total."""
    rng = random.Random(seed + 1)
    pairs = []
    for row in bench_rows(n, seed):
        *steps, answer = row["output"].split("\n")
        total = int(answer.split()[-1])
        wrong = "\n".join(steps[:-1] or steps) + f"\n答案 {total + rng.randint(1, 9)}"
        pairs.append({"instruction": row["instruction"], "input": row["input"], "chosen": row["output"],
                      "rejected": wrong})
    return pairs


def stage_config(stage: str, model_dir: Path, data: Path, args: argparse.Namespace, out: Path) -> Any:
    from rlkit import stages

    kind = stage.split("-")[0]
    return stages.load(kind, ROOT / "recipes" / f"tiny-{kind}.yaml", [
        *(["dpo.padding_free=true"] if stage == "dpo-pf" else []),
        f"output_dir={out}", f"seed={args.seed}", f"model.path={model_dir}", f"model.dtype={args.dtype}", "device=cpu",
        f"data.train={data}", "data.eval=null", "data.build_synthetic_if_missing=null",
        f"data.cutoff_len={args.cutoff}",
        "curriculum.enabled=false", f"train.micro_batch_size={args.micro_batch}", "train.grad_accum=1",
        "train.num_learners=1", f"train.max_steps={args.steps}", f"optim.lr={args.lr}", "optim.scheduler=cosine",
        f"optim.warmup_steps={args.warmup}", "optim.weight_decay=0.0", "optim.max_grad_norm=1.0", "eval.every=0",
        "checkpoint.every=0", "checkpoint.resume=never", "overwrite=true", "logging.tensorboard=false",
        "logging.progress=none", "logging.every=1", "finetuning=full"])


def pair_tokens(pair: dict[str, list[int]]) -> int:
    return sum(len(pair[k]) for k in ("chosen_prompt", "chosen_ids", "rejected_prompt", "rejected_ids"))


def bench_rlkit(stage: str, cfg: Any, pairs: list[dict], schedule: list[list[int]],
                args: argparse.Namespace) -> tuple[list[tuple[int, float]], float]:
    """Run the stage, then (tokens, seconds) of each timed step and the learner's peak (GiB)."""
    from rlkit.dpo.run import run_dpo
    from rlkit.rm.run import run_rm
    from rlkit.run.metrics import read_jsonl

    (run_rm if stage == "rm" else run_dpo)(cfg)
    records = [r for r in read_jsonl(Path(cfg.output_dir) / "metrics.jsonl") if "time/step" in r]
    if len(records) != args.steps:
        raise RuntimeError(f"{cfg.output_dir}: {len(records)} step records, expected {args.steps}")
    steps = [(sum(pair_tokens(pairs[i]) for i in rows), rec["time/step"])
             for rec, rows in zip(records, schedule) if rec["step"] > args.warmup]
    peak = max(r.get("memory/learner_peak_gib", 0.0) for r in records)
    return steps, peak


def bench_trl(stage: str, model_dir: str, ordered: list[dict], args: dict[str, Any],
              out: str) -> tuple[list[tuple[int, float]], float]:
    """TRL's trainer for `stage` on `ordered` (rlkit's pairs in rlkit's step order), in a process of
    its own: (tokens, seconds) of each timed step and the process's peak resident memory (GiB)."""
    import resource

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stamps: list[tuple[float, int]] = []
    seen = [0]

    class Stamp(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.append((time.perf_counter(), seen[0]))

    common = dict(output_dir=out, per_device_train_batch_size=args["micro_batch"], gradient_accumulation_steps=1,
                  max_steps=args["steps"], learning_rate=args["lr"], lr_scheduler_type="cosine",
                  warmup_steps=args["warmup"], weight_decay=0.0, max_grad_norm=1.0, bf16=args["dtype"] == "bf16",
                  report_to=[], save_strategy="no", eval_strategy="no", logging_steps=args["steps"], use_cpu=True,
                  seed=args["seed"], disable_tqdm=True, train_sampling_strategy="sequential",
                  max_length=args["cutoff"], dataloader_num_workers=0)
    text = Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])  # what its init prepares
    if stage != "rm":  # TRL 1.16 has no padding-free DPO (it falls back to padding): dpo-pf's TRL side pads
        from trl import DPOConfig, DPOTrainer

        base = DPOTrainer
        rows = [{"prompt_ids": p["chosen_prompt"], "chosen_ids": p["chosen_ids"], "rejected_ids": p["rejected_ids"]}
                for p in ordered]
        config = DPOConfig(**common, beta=0.1, loss_type=["sigmoid"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        from trl import RewardConfig, RewardTrainer

        base = RewardTrainer
        rows = [{"chosen_ids": p["chosen_prompt"] + p["chosen_ids"],
                 "rejected_ids": p["rejected_prompt"] + p["rejected_ids"]} for p in ordered]
        config = RewardConfig(**common)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id

    class Counting(base):
        def training_step(self, model: Any, inputs: dict, *rest: Any, **kw: Any) -> Any:
            seen[0] += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *rest, **kw)

    trainer = Counting(model=model, args=config, train_dataset=text, processing_class=tokenizer, callbacks=[Stamp()])
    trainer.train_dataset = Dataset.from_list(rows)  # the very ids rlkit trains on, in its order
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if len(stamps) != args["steps"]:
        raise RuntimeError(f"TRL ran {len(stamps)} steps, expected {args['steps']}")
    timed = zip(stamps[args["warmup"] - 1:], stamps[args["warmup"]:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    return [(k1 - k0, t1 - t0) for (t0, k0), (t1, k1) in timed], peak


def bench_stage(stage: str, model_dir: Path, data: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both trainers, `--repeat` times each in alternating order."""
    from transformers import AutoTokenizer

    from rlkit.dpo.run import load_pair_data
    from rlkit.run.driver import curriculum_sampler

    cfg = stage_config(stage, model_dir, data, args, work / f"rlkit-{stage}-0")
    pairs = load_pair_data(cfg.data, AutoTokenizer.from_pretrained(model_dir), cfg.seed).train
    sampler = curriculum_sampler(cfg.curriculum, [None] * len(pairs), args.steps, args.micro_batch, cfg.seed,
                                 cfg.data.train)
    schedule = [sampler.next_batch() for _ in range(args.steps)]
    ordered = [pairs[i] for rows in schedule for i in rows]
    runs: dict[str, list] = {"rlkit": [], "trl": []}
    peaks: dict[str, list[float]] = {"rlkit": [], "trl": []}
    for r in range(args.repeat):
        for side in ("rlkit", "trl") if r % 2 == 0 else ("trl", "rlkit"):
            if side == "rlkit":
                cfg = stage_config(stage, model_dir, data, args, work / f"rlkit-{stage}-{r}")
                steps, peak = bench_rlkit(stage, cfg, pairs, schedule, args)
            else:
                steps, peak = run_spawned(bench_trl, stage, str(model_dir), ordered, vars(args),
                                          str(work / f"trl-{stage}-{r}"))
            runs[side].append(steps)
            peaks[side].append(peak)
    rates = {side: spread([t / s for run in rs for t, s in run]) for side, rs in runs.items()}
    return {"rlkit": rates["rlkit"], "trl": rates["trl"], "ratio": rates["rlkit"]["median"] / rates["trl"]["median"],
            "rlkit_peak_gib": max(peaks["rlkit"]), "trl_peak_gib": max(peaks["trl"]), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    from rlkit.tiny import build_tiny_model

    started = time.perf_counter()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-dpo-")
    work = Path(args.workdir or tmp.name)
    try:
        model_dir = work / f"model-{args.size}"
        if not (model_dir / "config.json").exists():
            build_tiny_model(model_dir, args.size, seed=args.seed)
        data = work / "data" / "pairs.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in bench_pairs(args.rows, args.seed)),
                        encoding="utf-8")
        results = {stage: bench_stage(stage, model_dir, data, args, work) for stage in args.stages}
        elapsed = time.perf_counter() - started
        print(f"{model_line(model_dir, args.size)}, {args.dtype}, cpu threads {os.environ['OMP_NUM_THREADS']}, "
              f"{args.micro_batch} pairs a step, grad_accum 1, steps {args.steps} (first {args.warmup} not timed) x "
              f"{args.repeat} run(s), cutoff {args.cutoff}, {args.rows} pairs, {machine()}")
        print("tokens/s per step = real tokens of the step's chosen and rejected rows / step time, over the timed "
              "steps of all runs; ratio = of the medians; peak = the training process's largest resident memory")
        print(f"{'stage':<7}{'side':<7}{'median':>9}{'min':>9}{'max':>9}{'n':>4}{'peak GiB':>10}{'ratio':>8}")
        for stage, r in results.items():
            for side, label in (("rlkit", "rlkit"), ("trl", "TRL")):
                s = r[side]
                tail = f"{r['ratio']:>7.2f}x" if side == "rlkit" else ""
                print(f"{stage:<7}{label:<7}{s['median']:>9.1f}{s['min']:>9.1f}{s['max']:>9.1f}{s['n']:>4d}"
                      f"{r[side + '_peak_gib']:>10.2f}{tail}")
        print(f"total time {elapsed:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "seconds": elapsed},
                                                  indent=1), encoding="utf-8")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
