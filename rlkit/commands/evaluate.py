"""`rlkit eval MODEL --data FILE --rewards fn[,fn] [--samples k]`: score a model on prompts.

    rlkit eval runs/sft/final  --data prompts.jsonl --rewards rewards.exact:exact_match --samples 8
    rlkit eval runs/grpo/final --recipe recipes/tiny-grpo.yaml        # the recipe's held-out eval

vLLM generates `k` completions per prompt (rendered with the template training used), the reward
functions score them: the mean reward (total and per function), pass@1 and pass@k per function
(a completion passes when the function gives it >= --pass-threshold), the mean completion length
and the share cut at max_tokens, and a few sample completions. The JSON goes to stdout (or
--out), a summary to the console, the engine's own output to a log file. It is the code of
GRPO's held-out eval (`grpo.experience.evaluate_rows`): with --recipe, the same rows (data.eval,
else data.train), template, sampling (eval.temperature, rollout.max_tokens / stop) and seed as
the run's eval.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlkit.errors import UserError

SHOWN = 3  # sample completions in the JSON (and on the console)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="score a model on prompts with vLLM and reward functions (JSON out)",
                       description="score a model directory on a prompt dataset: mean reward per function, pass@k, "
                                   "completion length, sample completions")
    p.add_argument("model", help="a HF model folder (final/, or rlkit export / merge output), or a .gguf file")
    p.add_argument("--data", help="prompt rows in any format training reads (default: the --recipe's data.eval, "
                                  "else data.train)")
    p.add_argument("--rewards", help="fn[,fn]: module:function or file.py:function (default: the --recipe's rewards)")
    p.add_argument("--recipe", help="a GRPO recipe: its rewards, data, template, eval sampling and seed")
    p.add_argument("--samples", type=int, default=None, help="completions per prompt, k of pass@k (default: the "
                                                             "recipe's eval.samples_per_prompt, else 1)")
    p.add_argument("--temperature", type=float, default=None, help="default: the recipe's eval temperature, else 0 "
                                                                   "(greedy) for one sample and 1 for more")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the recipe's rollout.max_tokens, else 256")
    p.add_argument("--template", default=None, choices=["auto", "alpaca", "chat"],
                   help="as data.template (default: the recipe's, else auto)")
    p.add_argument("--format", default=None, help="row format, as data.format (default: auto)")
    p.add_argument("--dataset", default=None, help="entry name when --data is a dataset_info.json")
    p.add_argument("--limit", type=int, default=None, help="score the first N rows only")
    p.add_argument("--calculator", action="store_true", default=None,
                   help="the inline calculator writes the arithmetic, as rollout.calculator (default: the recipe's)")
    p.add_argument("--pass-threshold", type=float, default=1.0, help="a completion passes at this reward (default 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the recipe's eval seed, else 0)")
    p.add_argument("--by", default=None, metavar="COLUMN",
                   help="also report the means per value of this data column (e.g. source)")
    p.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    p.add_argument("--per-sample", default=None, metavar="FILE",
                   help="write every completion with its row's columns and rewards here (JSONL)")
    p.add_argument("--log", default=None, help="the engine's output (default: a file in the temp folder)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rlkit import console
    from rlkit.grpo.experience import evaluate_rows

    cfg, base = _config(args)
    console.quiet_driver()
    task, rows = _task(cfg, base, args.limit)
    if args.by and not any(args.by in row for row in rows):
        raise UserError(f"--by: no row of {cfg.data.train} has a column {args.by!r} (columns: "
                        f"{', '.join(sorted(rows[0]))})")
    sampling, n, seed = _sampling(args, cfg)
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"rlkit-eval-{os.getpid()}.log"
    print(f"rlkit eval: {args.model} on {len(rows)} prompts x {n} samples (temperature {sampling.temperature:g}, "
          f"max_tokens {sampling.max_tokens}, {task.template} template"
          f"{', the inline calculator' if cfg.rollout.calculator else ''}); the engine's output: {log}",
          file=sys.stderr, flush=True)
    with console.output_to(log):
        from rlkit.rollout.local import LocalEngine

        engine = LocalEngine(cfg)
        evaluation = evaluate_rows(task, rows, engine, sampling, n, seed)
    report = _report(args, cfg.data.train, task, evaluation, sampling, seed)
    if args.per_sample:
        _write_samples(Path(args.per_sample), evaluation)
    for line in _summary(report):
        print(f"rlkit eval: {line}", file=sys.stderr)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"rlkit eval: wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0


def _config(args: argparse.Namespace) -> tuple[Any, str | None]:
    """A GRPO config for the model and data (the recipe's, with these overrides), and the folder
    reward file paths are relative to."""
    from rlkit import stages
    from rlkit.grpo.task import recipe_dir
    from rlkit.model.gguf import import_gguf, is_gguf
    from rlkit.recipe import build
    from rlkit.reward.contract import RewardSpec

    if is_gguf(args.model):
        args.model = str(import_gguf(args.model, key="rlkit eval"))
    if not (Path(args.model) / "config.json").is_file():
        hint = (" (a LoRA adapter: give final/, which holds the merged model, or rlkit merge it first)"
                if (Path(args.model) / "adapter_config.json").is_file() else "")
        raise UserError(f"rlkit eval: {args.model} has no config.json: give a HF model folder{hint}")
    if args.samples is not None and args.samples < 1:
        raise UserError(f"--samples: must be >= 1, got {args.samples}")
    rewards = [RewardSpec(fn=fn.strip()) for fn in args.rewards.split(",") if fn.strip()] if args.rewards else None
    if args.recipe:
        cfg = stages.load("grpo", args.recipe, [f"model.path={args.model}"])
        base = recipe_dir(args.recipe)
    else:
        if not args.data or not rewards:
            raise UserError("rlkit eval: give --data and --rewards (or a --recipe that names them)")
        cfg = build(stages.config_types()["grpo"], {"model": {"path": args.model}, "data": {"train": args.data},
                                            "rewards": [{"fn": r.fn} for r in rewards], "output_dir": "unused"},
                    "rlkit eval")
        base = os.getcwd()
    data = cfg.data
    if args.data:  # these rows, scored as they come
        data = dataclasses.replace(data, train=args.data, eval=None)
    elif data.eval:
        data = dataclasses.replace(data, train=data.eval, eval=None)
    data = dataclasses.replace(data, format=args.format or data.format, dataset=args.dataset or data.dataset,
                               template=args.template or data.template, build_synthetic_if_missing=None)
    if args.calculator:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, calculator=True))
    cfg = dataclasses.replace(cfg, data=data, rewards=tuple(rewards) if rewards else cfg.rewards,
                              eval=dataclasses.replace(cfg.eval, every=0))  # the rows to score are data.train now
    return cfg, base


def _task(cfg: Any, base: str | None, limit: int | None) -> tuple[Any, list[dict]]:
    from rlkit.accel import detect
    from rlkit.grpo.task import load_task

    task = load_task(cfg.model, cfg.data, cfg.rewards, cfg.grpo.reward_default, base, cfg.seed, cfg.rollout,
                     on_cpu=not detect(cfg.device).is_accelerator)
    rows = task.rows[:limit] if limit else task.rows
    if not rows:
        raise UserError(f"{cfg.data.train}: no rows")
    return task, rows


def _sampling(args: argparse.Namespace, cfg: Any) -> tuple[Any, int, int]:
    from rlkit.grpo.run import eval_sampling
    from rlkit.seeding import derive_seed

    n = args.samples or (cfg.eval.samples_per_prompt if args.recipe else 1)
    sampling = eval_sampling(cfg)  # the recipe's (or the rollout defaults)
    if args.temperature is not None or not args.recipe:
        temperature = args.temperature if args.temperature is not None else (0.0 if n == 1 else 1.0)
        sampling = dataclasses.replace(sampling, temperature=temperature)
    if args.max_tokens is not None:
        sampling = dataclasses.replace(sampling, max_tokens=args.max_tokens)
    seed = args.seed if args.seed is not None else derive_seed(cfg.seed, "eval")
    return sampling, n, seed


def _report(args: argparse.Namespace, data: str, task: Any, ev: Any, sampling: Any, seed: int) -> dict[str, Any]:
    names = list(ev.result.per_fn)
    metrics = ev.metrics()
    lengths = [len(s.token_ids) for s in ev.samples]
    ks = sorted({1, ev.n})
    return {
        "model": str(args.model), "data": str(data), "prompts": len(ev.rows),
        "samples_per_prompt": ev.n, "template": task.template, "seed": seed,
        "sampling": dataclasses.asdict(sampling),
        "reward": _num(metrics["eval/reward"]),
        "rewards": {name: _num(metrics[f"eval/{name}"]) for name in names},
        "pass_threshold": args.pass_threshold,
        "stderr": {name: _num(ev.stderr(name)) for name in names},
        "pass": {f"pass@{k}": {name: _num(ev.pass_at(name, k, args.pass_threshold)) for name in names} for k in ks},
        "completion_tokens": {"mean": sum(lengths) / len(lengths), "max": max(lengths),
                              "truncated_frac": sum(s.finish_reason == "length" for s in ev.samples) / len(lengths)},
        "examples": [{"prompt": ev.prompts[i // ev.n], "completion": ev.samples[i].text,
                      "rewards": {name: ev.result.per_fn[name][i] for name in names},
                      "total": _num(ev.result.total[i])} for i in range(0, min(len(ev.samples), SHOWN * ev.n), ev.n)],
        **({"by": {args.by: _by_column(ev, args.by)}} if args.by else {}),
    }


def _by_column(ev: Any, column: str) -> dict[str, dict[str, Any]]:
    """The prompts, means and standard errors of each reward function per value of `column`."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(ev.rows):
        groups.setdefault(str(row.get(column)), []).append(i)

    def stats(rows: list[int]) -> dict[str, Any]:
        return {"prompts": len(rows),
                **{name: {"mean": _num(ev.mean(name, rows)), "stderr": _num(ev.stderr(name, rows))}
                   for name in ev.result.per_fn}}

    return {value: stats(rows) for value, rows in sorted(groups.items())}


def _write_samples(path: Path, ev: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, sample in enumerate(ev.samples):
            row = ev.rows[i // ev.n]
            columns = {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool)) or v is None}
            f.write(json.dumps({"row": i // ev.n, "columns": columns, "completion": sample.text,
                                "tokens": len(sample.token_ids), "finish_reason": sample.finish_reason,
                                "rewards": {name: ev.result.per_fn[name][i] for name in ev.result.per_fn},
                                "total": _num(ev.result.total[i])}, ensure_ascii=False) + "\n")
    print(f"rlkit eval: wrote {path}", file=sys.stderr)


def _summary(report: dict[str, Any]) -> list[str]:
    per_fn = []
    for name, mean in report["rewards"].items():
        passes = ", ".join(f"{k} {_fmt(v[name])}" for k, v in report["pass"].items())
        per_fn.append(f"{name} {_fmt(mean)} ± {_fmt(report['stderr'][name])} ({passes})")
    tokens = report["completion_tokens"]
    lines = [f"reward {_fmt(report['reward'])}; " + "; ".join(per_fn),
             f"completions: {tokens['mean']:.1f} tokens on average, {tokens['truncated_frac']:.0%} cut at max_tokens"]
    for ex in report["examples"]:
        lines.append(f"e.g. {json.dumps(ex['prompt'][-60:], ensure_ascii=False)} -> "
                     f"{json.dumps(ex['completion'][:60], ensure_ascii=False)} (total {_fmt(ex['total'])})")
    return lines


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
