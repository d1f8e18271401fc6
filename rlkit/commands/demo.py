"""The embedded default: the tiny recipes as a user runs them, on CPU.

`rlkit demo` is `rlkit sft recipes/tiny-sft.yaml`, then `rlkit grpo recipes/tiny-grpo.yaml`, then
`rlkit plot runs/tiny-sft runs/tiny-grpo --out runs/tiny-plots` (the commands the README shows),
each run told to replace an earlier demo's. The SFT recipe builds the tiny model and the synthetic
task offline where its paths are empty. `out_dir` moves the recipes' `runs/` paths elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RUNS = "runs"  # where every path of the tiny recipes starts
AGAIN = ("overwrite=true", "checkpoint.resume=never")  # a second demo replaces the first one's runs
MOVED_KEYS = ("model.path", "data.train", "data.eval", "output_dir")
STAGES = ("sft", "grpo")  # the demo's runs, in order: each trains on the one before
SCORED = ("grpo",)  # the runs whose line gives their held-out accuracy


def run_demo(out_dir: str | Path = RUNS, stages: list[str] | None = None) -> Iterator[str]:
    """Yield one line per finished command, naming where its outputs are."""
    from rlkit.commands.plot import plot_runs

    out = Path(out_dir)
    ran = []
    for stage in stages or STAGES:
        final = _shown(_run_recipe(stage, out))
        ran.append(final.parent)
        line = f"rlkit {stage} recipes/tiny-{stage}.yaml: final model in {final}"
        if stage in SCORED:
            line += f"; {_accuracy_line(final.parent / 'metrics.jsonl')}"
        yield line
    curves = [p for p in plot_runs(ran, out / "tiny-plots") if p.name == "curves.png"]
    yield f"rlkit plot: {', '.join(str(p) for p in curves)} (and one PNG per panel beside each)"


def _run_recipe(stage: str, out: Path) -> Path:
    """Run recipes/tiny-<stage>.yaml with its paths under `out` instead of runs/; its final/ folder."""
    import yaml

    from rlkit import stages

    recipe = RECIPES / f"tiny-{stage}.yaml"
    doc = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    moved = []
    for key in MOVED_KEYS if out != Path(RUNS) else ():
        section, _, name = key.rpartition(".")
        value = (doc.get(section) or {}).get(name) if section else doc.get(name)
        if isinstance(value, str) and value.startswith(RUNS + "/"):
            moved.append(f"{key}={out / value[len(RUNS) + 1:]}")
    cfg = stages.load(stage, recipe, [*moved, *AGAIN])
    return Path(stages.resolve(stages.stage(stage).run)(cfg, recipe_path=recipe))


def _shown(path: Path) -> Path:
    """`path` relative to the working folder when it is inside it (as the recipe wrote it)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _accuracy_line(metrics: Path) -> str:
    """Held-out exact-answer accuracy at the first and last eval of a GRPO run."""
    import json

    rows = [json.loads(x) for x in metrics.read_text(encoding="utf-8").split("\n") if x.strip()]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    if len(evals) < 2:
        return "no held-out evals"
    (s0, a0), (s1, a1) = evals[0], evals[-1]
    return f"held-out exact-answer accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
