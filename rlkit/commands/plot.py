"""`rlkit plot RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG curves from the runs' `metrics.jsonl`.

One PNG per panel (reward, held-out, loss, KL, clip fractions, completion length, time per step,
learning rate, curriculum mix: each only when a run logged its metrics) and `curves.png` with all
of them in a grid. Several runs are overlaid, one colour per run. A folder without
`metrics.jsonl` whose subfolders have one (a folder of runs) stands for those runs;
runs of different stages are drawn apart, under DIR/<stage>/. Drawn with matplotlib's Agg
backend: no display needed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import UserError

PANEL_W, PANEL_H, DPI, COLUMNS = 4.8, 3.2, 100, 3  # inches, dots per inch: a panel is 480 x 320 px
STACKED = ("time/generate", "time/ref", "time/reward", "time/train", "time/sync")  # what a GRPO step spends
LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    name: str  # the PNG's file name, without .png
    title: str
    ylabel: str
    series: Callable[[set[str]], list[str]]  # the metric names it draws, from those the runs logged
    smooth: bool = False  # a noisy per-step metric: faint raw values under a rolling mean


def _named(*names: str) -> Callable[[set[str]], list[str]]:
    return lambda keys: [n for n in names if n in keys]


def _prefixed(prefix: str, suffix: str = "", skip: tuple[str, ...] = ()) -> Callable[[set[str]], list[str]]:
    return lambda keys: sorted(k for k in keys if k.startswith(prefix) and k.endswith(suffix) and k not in skip
                               and k.count("/") == prefix.count("/") + suffix.count("/"))


PANELS = (
    Panel("reward", "reward (mean over the step's completions)", "reward",
          lambda keys: _named("reward/mean")(keys) + _prefixed("reward/", "/mean")(keys), smooth=True),
    Panel("held_out", "held-out evaluation", "score", _prefixed("eval/", skip=("eval/loss", "eval/kl"))),
    Panel("loss", "loss", "loss", _named("train/loss", "eval/loss"), smooth=True),
    Panel("preference", "preference accuracy (chosen reward above rejected)", "share of pairs",
          _named("train/rewards/accuracies", "eval/rewards/accuracies"), smooth=True),
    Panel("margin", "rewards (beta x log-ratio to the reference) and their margin", "reward",
          _named("train/rewards/margins", "eval/rewards/margins", "train/rewards/chosen", "train/rewards/rejected"),
          smooth=True),
    Panel("kl", "KL to the reference (and engine / learner mismatch)", "KL",
          _named("train/kl_mean", "train/mismatch/kl", "train/kl", "eval/kl"), smooth=True),
    Panel("clip", "clipped fraction of tokens", "fraction", _named("train/clip_frac", "train/clip_frac_low",
                                                                    "train/clip_frac_high")),
    Panel("length", "completion length", "tokens", _named("completion/len_mean", "completion/len_max"),
          smooth=True),
    Panel("time", "time per step", "seconds", lambda keys: [k for k in STACKED if k in keys] or
          _named("time/step")(keys), smooth=True),
    Panel("utilisation", "engine busy fraction and sync share of the step", "fraction",
          _named("rollout/busy_fraction", "rollout/busy_fraction_min", "time/sync_share"), smooth=True),
    Panel("lr", "learning rate", "lr", _named("train/lr")),
    Panel("mix", "curriculum mix (share of the step's rows)", "share", _prefixed("mix/")),
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="PNG curves (reward, held-out, loss, KL, clipping, length, time) of runs",
                       description="PNG curves from metrics.jsonl of one run or several, overlaid")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (the output_dir of rlkit sft / grpo)")
    p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots for one folder, else plots)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "plots" if len(args.runs) == 1 else Path("plots"))
    written = plot_runs([Path(r) for r in args.runs], out)
    for folder in dict.fromkeys(p.parent for p in written):
        names = [p.stem for p in written if p.parent == folder and p.name != "curves.png"]
        print(f"rlkit plot: {folder}/curves.png and one PNG per panel ({', '.join(names)})")
    return 0


def find_runs(folders: list[Path]) -> list[Path]:
    """Run folders (those with metrics.jsonl); a folder that holds runs stands for them."""
    runs: list[Path] = []
    for folder in folders:
        if (folder / "metrics.jsonl").is_file():
            runs.append(folder)
            continue
        inner = sorted(p.parent for p in folder.glob("*/metrics.jsonl")) if folder.is_dir() else []
        if not inner:
            what = "does not exist" if not folder.exists() else "has no metrics.jsonl (nor do its subfolders)"
            raise UserError(f"rlkit plot: {folder} {what}: give the output_dir of an rlkit sft / grpo run")
        runs.extend(inner)
    return runs


def plot_runs(folders: list[Path], out: Path) -> list[Path]:
    """Draw every panel the runs have metrics for; return the PNGs written (curves.png last)."""
    from rlkit.run.metrics import read_jsonl

    runs = find_runs(folders)
    by_stage: dict[str, list[Path]] = {}
    for run in runs:
        by_stage.setdefault(_stage(run), []).append(run)
    written: list[Path] = []
    for stage, members in by_stage.items():
        records = {_label(run, runs): read_jsonl(run / "metrics.jsonl") for run in members}
        if not any(records.values()):
            raise UserError(f"rlkit plot: {', '.join(str(r) for r in members)}: metrics.jsonl is empty "
                            "(the run logged no step yet)")
        written += draw(records, out / stage if len(by_stage) > 1 else out)
    return written


def draw(records: dict[str, list[dict[str, Any]]], out: Path) -> list[Path]:
    """One PNG per panel with data, and curves.png with all of them; `records`: label -> metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for rows in records.values() for row in rows for k in row}
    panels = [(p, p.series(keys)) for p in PANELS if p.series(keys)]
    out.mkdir(parents=True, exist_ok=True)
    rows_n = -(-len(panels) // COLUMNS)
    cols_n = min(COLUMNS, len(panels))
    grid, axes = plt.subplots(rows_n, cols_n, figsize=(cols_n * PANEL_W, rows_n * PANEL_H), dpi=DPI,
                              squeeze=False, layout="constrained")
    written = []
    for i, (panel, series) in enumerate(panels):
        fig, ax = plt.subplots(figsize=(PANEL_W, PANEL_H), dpi=DPI, layout="constrained")
        for target in (ax, axes[i // cols_n][i % cols_n]):
            _draw_panel(target, panel, series, records)
        path = out / f"{panel.name}.png"
        fig.savefig(path, metadata={"Title": panel.title, "Description": f"panels: {panel.name}"})
        plt.close(fig)
        written.append(path)
    for j in range(len(panels), rows_n * cols_n):
        axes[j // cols_n][j % cols_n].axis("off")
    path = out / "curves.png"
    grid.savefig(path, metadata={"Title": "rlkit curves",
                                 "Description": "panels: " + " ".join(p.name for p, _ in panels)})
    plt.close(grid)
    return written + [path]


def _draw_panel(ax: Any, panel: Panel, series: list[str], records: dict[str, list[dict[str, Any]]]) -> None:
    import numpy as np

    colours = [f"C{i}" for i in range(10)]
    several = len(records) > 1
    if panel.name == "time" and several:  # several runs: the whole step, overlaid
        series = ["time/step"]
    for r, (label, rows) in enumerate(records.items()):
        if panel.name == "time" and not several and len(series) > 1:  # one run: how each step is split
            steps = [row["step"] for row in rows if all(k in row for k in series)]
            parts = [[row[k] for row in rows if all(k in row for k in series)] for k in series]
            ax.stackplot(steps, parts, labels=[k.split("/", 1)[1] for k in series])
            continue
        for s, key in enumerate(series):
            points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
            if not points:
                continue
            x, y = np.array(points, dtype=float).T
            colour = colours[r % 10] if several else colours[s % 10]
            style = LINESTYLES[s % len(LINESTYLES)] if several else "-"
            name = (f"{label}: " if several else "") + _short(key, series)
            sparse = key.startswith("eval/")  # held-out metrics come every few steps: mark them
            if panel.smooth and len(x) > 60 and not sparse:  # faint raw values under their rolling mean
                ax.plot(x, y, color=colour, linestyle=style, alpha=0.25, linewidth=0.8)
                y = _rolling_mean(y, max(2, len(x) // 30))
            ax.plot(x, y, color=colour, linestyle=style, marker="o" if sparse else None, markersize=3, label=name)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if panel.name == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _rolling_mean(y: Any, window: int) -> Any:
    """The mean of each value and the window - 1 before it (fewer at the start: the curve starts where the run did)."""
    import numpy as np

    sums = np.cumsum(np.insert(y, 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - window)
    return (sums[i] - sums[lo]) / (i - lo)


def _short(key: str, series: list[str]) -> str:
    """reward/exact_match/mean -> exact_match; a panel of one section drops it."""
    parts = key.split("/")
    if parts[-1] == "mean" and len(parts) == 3:
        parts = parts[:-1]
    if len({s.split("/")[0] for s in series}) == 1 and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts)


def _stage(run: Path) -> str:
    config = run / "config.yaml"
    if config.is_file():
        for line in config.read_text(encoding="utf-8").splitlines():
            if line.startswith("stage:"):
                return line.split(":", 1)[1].strip()
    return "run"


def _label(run: Path, runs: list[Path]) -> str:
    """The run's folder name, with its parent's where two runs share a name."""
    if [r.name for r in runs].count(run.name) > 1:
        return f"{run.parent.name}/{run.name}"
    return run.name
