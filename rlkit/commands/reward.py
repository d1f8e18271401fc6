"""``rlkit reward test``: run reward functions over sample rows before a training run.

    rlkit reward test module:function --data samples.jsonl [--recipe recipe.yaml]
                      [--model DIR] [--arg k=v ...]

Rows: any file and row format training reads (JSONL, a JSON list, parquet/CSV, a
dataset_info.json entry with ``--dataset``; prompt/answer, alpaca or chat rows), with a
``completion`` column or ``--model`` to generate one; alpaca and chat rows without either are
scored on their own response (``output``, the last assistant turn). With ``--recipe`` and no
``--data``, the recipe's ``data.train`` is read.
Prints per-function statistics, failures with the offending sample, the slowest
functions, and reward-hacking probes. Exit status: 0 ok, 1 a call failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from rlkit.errors import RewardError, UserError
from rlkit.reward.contract import RewardResult, RewardSpec, preview
from rlkit.reward.score import RewardScorer

_ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target", "reference")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``reward test`` to an argparse subparsers object; returns the ``reward`` parser."""
    p = subparsers.add_parser("reward", help="reward-function tools")
    sub = p.add_subparsers(dest="reward_command", required=True)
    t = sub.add_parser("test", help="run rewards over sample rows and probe for reward hacking")
    t.add_argument("fn", nargs="?", help="module:function or path/to/file.py:function "
                                         "(default: every reward of --recipe)")
    t.add_argument("--data", help="rows in any format training reads, with a `completion` column (or --model); "
                                  "default: the --recipe's data.train")
    t.add_argument("--format", default=None, help="row format, as data.format (default: the recipe's, else auto)")
    t.add_argument("--dataset", default=None, help="entry name when --data is a dataset_info.json")
    t.add_argument("--recipe", help="recipe YAML; its `rewards:` list is used")
    t.add_argument("--model", help="model directory: generate the completions from the prompts")
    t.add_argument("--arg", action="append", default=[], metavar="K=V",
                   help="argument for the function (value parsed as YAML), repeatable")
    t.add_argument("--max-new-tokens", type=int, default=64, help="with --model (default 64)")
    t.add_argument("--template", default=None, choices=["auto", "alpaca", "chat"],
                   help="with --model: the prompt template, as data.template (default: the recipe's, else auto)")
    t.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Entry point; returns the exit status."""
    from rich.console import Console

    console = Console(width=max(120, Console().width), soft_wrap=False)
    try:
        specs, base_dir, data = _specs(args)
        rows = _rows(args, data, need_completion=not args.model)
        columns = sorted({k for r in rows for k in r} - {"prompt", "completion", "completion_ids"})
        prompts = [r["prompt"] for r in rows]
        if args.model:
            completions, ids = _generate(args.model, rows, args.template or data.get("template") or "auto",
                                         args.max_new_tokens)
        else:
            # chat prompts get chat completions, as in a GRPO run (TRL's shape)
            completions = [[{"role": "assistant", "content": r["completion"]}]
                           if isinstance(r["prompt"], list) and isinstance(r["completion"], str) else r["completion"]
                           for r in rows]
            ids = [r["completion_ids"] for r in rows] if all("completion_ids" in r for r in rows) else None
        cols = {c: [r.get(c) for r in rows] for c in columns}
        scorer = RewardScorer(specs, base_dir, set(columns), collect_errors=True)
        scorer.check_rows(str(args.data or data.get("train")), rows)
        result = scorer.score(prompts, completions, ids, cols)
        probes = _probes(scorer, rows[0], completions[0], columns, ids is not None)
    except UserError as e:  # bad input or a broken reward: one line, exit 2
        print(f"rlkit reward test: {e}", file=sys.stderr)
        return 2
    _print_stats(console, scorer, result, prompts, completions)
    bad = _print_probes(console, scorer, result, probes)
    failed = any(result.failures.values()) or bad
    console.print("[red]FAILED[/red]: a reward call failed (see above)" if failed else "[green]OK[/green]")
    return 1 if failed else 0


def _specs(args: argparse.Namespace) -> tuple[list[RewardSpec], str, dict[str, Any]]:
    """The rewards to test, the folder their file paths are relative to, the recipe's `data:`."""
    extra = {}
    for kv in args.arg:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise UserError(f"--arg {kv!r}: expected key=value")
        extra[k] = _yaml().safe_load(v)
    if not args.recipe:
        if not args.fn:
            raise UserError("name a reward (module:function) or pass --recipe")
        return [RewardSpec(fn=args.fn, args=extra)], os.getcwd(), {}
    recipe = _read_recipe(args.recipe)
    specs = [spec for i, e in enumerate(recipe["rewards"]) if (spec := _recipe_spec(args, i, e, extra))]
    if not specs:
        raise UserError(f"--recipe: no reward with fn {args.fn!r} in {args.recipe}")
    data = recipe.get("data") if isinstance(recipe.get("data"), dict) else {}
    return specs, os.path.dirname(os.path.abspath(args.recipe)), data


def _read_recipe(path: str) -> dict[str, Any]:
    """The recipe as YAML data, with a non-empty `rewards:` list (one line otherwise)."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = _yaml().safe_load(f) or {}
    except OSError as e:
        raise UserError(f"--recipe: cannot read {path}: {e.strerror}") from None
    except Exception as e:  # yaml.YAMLError
        raise UserError(f"--recipe: {path} is not valid YAML: {preview(str(e), 200)}") from None
    entries = recipe.get("rewards") if isinstance(recipe, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"--recipe: {path} has no `rewards:` list")
    return recipe


def _recipe_spec(args: argparse.Namespace, i: int, entry: Any, extra: dict[str, Any]) -> RewardSpec | None:
    """`rewards[i]` of the recipe with the command line's `--arg`s, None when `fn` names another."""
    if not isinstance(entry, dict) or "fn" not in entry:
        raise UserError(f"{args.recipe}: rewards[{i}]: expected a mapping with `fn:`")
    if args.fn and entry["fn"] != args.fn:
        return None
    try:
        return RewardSpec(**{**entry, "args": {**(entry.get("args") or {}), **extra}})
    except TypeError as err:
        raise UserError(f"{args.recipe}: rewards[{i}]: {err}") from None
    except RewardError as err:
        raise UserError(f"{args.recipe}: rewards[{i}].{err}") from None


def _yaml() -> Any:
    import yaml

    return yaml


def _rows(args: argparse.Namespace, data: dict[str, Any], need_completion: bool) -> list[dict]:
    """The rows, read by training's own loader; a `completion` per row unless generating."""
    from rlkit.data.formats import load_prompts

    path = args.data or data.get("train")
    if not path:
        raise UserError("--data: name the rows to score (or a --recipe whose data.train has them)")
    loaded = load_prompts(str(path), args.format or data.get("format") or "auto", args.dataset or data.get("dataset"),
                          split=None if args.data else data.get("split"))
    rows = list(loaded.rows)  # edited below (completion)
    if not rows:
        raise UserError(f"{loaded.source}: no rows")
    if need_completion and "completion" not in rows[0]:
        if "instruction" not in rows[0] and not isinstance(rows[0]["prompt"], list):
            raise UserError(f"{loaded.source}: row 1: no `completion` (add it, or pass --model to generate)")
        print(f"{loaded.source}: no `completion` column: scoring each row's own response "
              "(alpaca `output`, or the last assistant turn)", file=sys.stderr)
        for r in rows:
            r["completion"] = r["answer"]
    for n, r in enumerate(rows, 1):
        if need_completion and "completion" not in r:
            raise UserError(f"{loaded.source}: row {n}: no `completion` (add it, or pass --model to generate)")
    return rows


def _generate(model_dir: str, rows: list[dict], template: str, max_new_tokens: int) -> tuple[list, list]:
    """Greedy completions from a local HF causal LM, each prompt rendered as training renders it
    (`template`, as data.template: `auto` is the chat template for chat rows, else alpaca)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    except (OSError, ValueError) as e:
        raise UserError(f"--model: cannot load {model_dir}: {preview(str(e), 200)}") from None
    import torch

    from rlkit.data.templates import render_prompt, resolve_template

    template = resolve_template(template, rows[0], tok, "--data")
    completions, ids = [], []
    for row in rows:
        p = row["prompt"]
        enc = tok(render_prompt(row, template, tok), return_tensors="pt", add_special_tokens=template == "alpaca")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        completions.append([{"role": "assistant", "content": text}] if isinstance(p, list) else text)
        ids.append(new)
    return completions, ids


def _probes(scorer: RewardScorer, row: dict, completion: Any, columns: list[str],
            with_ids: bool) -> list[tuple[str, Any, RewardResult]]:
    """Score degenerate completions for the first row: what does an exploit earn?

    With token ids in the data, a probe's ``completion_ids`` has one id per character.
    """
    text = completion if isinstance(completion, str) else json.dumps(completion, ensure_ascii=False)
    as_msg = (lambda s: s) if isinstance(completion, str) else (lambda s: [{"role": "assistant", "content": s}])
    base = text if isinstance(completion, str) else (completion[-1].get("content", "") if completion else "")
    ans_col = next((c for c in _ANSWER_COLUMNS if c in columns), None)
    cases = [("empty completion", ""), ("repeated text (x8)", base * 8)]
    if ans_col is not None:
        cases.append((f"{ans_col} repeated x50", " ".join([str(row[ans_col])] * 50)))
        # a truncated rollout whose reasoning mentions the answer: should it count?
        cases.append((f"{ans_col} only in unfinished <think>", f"<think>maybe \\boxed{{{row[ans_col]}}}"))
    cases.append(("overlong (10k chars)", (base or "x") * (10_000 // max(1, len(base or "x")) + 1)))
    if any(_runs_code(r) for r in scorer.rewards):  # what a policy might write instead of a solution
        from rlkit.sandbox.probes import code_probes

        tests = next((row[c] for c in ("test_cases", "verification_info") if row.get(c) is not None), None)
        walled = all(getattr(r.fn, "rlkit_runs_code", None) == "sandbox" for r in scorer.rewards if _runs_code(r))
        cases += code_probes(tests, resources=walled)
        if not walled:
            print("rlkit reward test: the flood, hang and fork-bomb probes are skipped: a reward here runs code "
                  'without declaring a sandbox (fn.rlkit_runs_code = "sandbox")', file=sys.stderr)
    out = []
    cols = {c: [row.get(c)] for c in columns}
    for label, c in cases:
        ids = [[0] * len(c)] if with_ids else None
        out.append((label, c, scorer.score([row["prompt"]], [as_msg(c)], ids, cols)))
    return out


def _runs_code(r: Any) -> bool:
    return bool(getattr(r.fn, "rlkit_runs_code", False))


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _print_stats(console: Any, scorer: RewardScorer, result: RewardResult, prompts: list, completions: list) -> None:
    from rich.table import Table

    n = len(completions)
    t = Table(title=f"rewards over {n} rows")
    for col in ("function", "weight", "mean", "std", "min", "max", "None", "errors", "seconds", "ms/row"):
        t.add_column(col, justify="left" if col == "function" else "right")
    m = result.metrics()
    for r in scorer.rewards:
        vals = [v for v in result.per_fn[r.name] if v is not None]
        fails = len(result.failures.get(r.name, []))
        t.add_row(r.name, f"{r.spec.weight:g}", _fmt(m[f"reward/{r.name}/mean"]), _fmt(m[f"reward/{r.name}/std"]),
                  _fmt(min(vals) if vals else None), _fmt(max(vals) if vals else None),
                  str(n - len(vals) - fails), str(fails), f"{result.seconds[r.name]:.3f}",
                  f"{1000 * result.seconds[r.name] / n:.1f}")
    t.add_row("[bold]total[/bold]", "", _fmt(m["reward/mean"]), _fmt(m["reward/std"]),
              _fmt(min(result.total)), _fmt(max(result.total)), "", "", "", "")
    console.print(t)
    slow = sorted(result.seconds.items(), key=lambda kv: -kv[1])
    console.print("slowest: " + ", ".join(f"{k} {v:.3f} s" for k, v in slow))
    for name, fails in result.failures.items():
        console.print(f"[red]{name}: {len(fails)} failed[/red]")
        for i, msg in fails[:3]:
            console.print(f"  row {i}: {msg}" if i >= 0 else f"  {msg}", markup=False, highlight=False)


def _print_probes(console: Any, scorer: RewardScorer, result: RewardResult,
                  probes: list[tuple[str, Any, RewardResult]]) -> bool:
    from rich.table import Table

    t = Table(title="reward-hacking probes (row 0); flagged when a probe scores >= the data mean, "
                    "or a sandbox probe scores above 0")
    t.add_column("probe")
    t.add_column("completion")
    for name in scorer.names:
        t.add_column(name, justify="right")
    t.add_column("total", justify="right")
    t.add_column("flag")
    data_mean = result.metrics()["reward/mean"]
    failed = False
    for label, c, res in probes:
        failed |= any(res.failures.values())
        cells = ["error" if res.failures.get(n) else _fmt(res.per_fn[n][0]) for n in scorer.names]
        tot = res.total[0]
        flag = "[yellow]⚠ scores like real data[/yellow]" if not math.isnan(tot) and not math.isnan(data_mean) \
            and tot >= data_mean and tot > 0 else ""
        if label.startswith("sandbox: "):
            forged = [r.name for r in scorer.rewards if _runs_code(r) and (res.per_fn[r.name][0] or 0) > 0]
            flag = f"[red]⚠ forged: {', '.join(forged)} > 0[/red]" if forged else "[green]contained[/green]"
        t.add_row(label, preview(c, 30) or "''", *cells, _fmt(tot), flag)
    console.print(t)
    for label, _, res in probes:
        for fails in res.failures.values():
            console.print(f"probe {label!r}: {fails[0][1]}", markup=False, highlight=False)
    return failed
