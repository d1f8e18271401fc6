"""The embedded default: build the tiny model and task offline, then SFT and GRPO on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
AGAIN = ("overwrite=true", "checkpoint.resume=never")  # a second demo replaces the first one's runs


def run_demo(out_dir: str | Path = "runs/demo", stages: list[str] | None = None) -> Iterator[str]:
    """Yield one line per finished step, naming where its outputs are."""
    from rlkit.stages import load
    from rlkit.tiny import build_tiny_model, write_task_data

    out = Path(out_dir)
    model_dir = out / "tiny-model"
    data_dir = out / "data"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, "tiny")
    paths = write_task_data(data_dir, seed=0)
    yield f"tiny model: {model_dir}"
    yield f"synthetic data: {', '.join(str(p) for p in paths.values())}"
    wanted = stages or ["sft", "grpo"]
    if "sft" in wanted:
        from rlkit.sft.run import run_sft

        cfg = load("sft", RECIPES / "tiny-sft.yaml", [
            f"model.path={model_dir}", f"data.train={data_dir / 'sft_train.jsonl'}",
            f"data.eval={data_dir / 'sft_eval.jsonl'}", f"output_dir={out / 'sft'}", *AGAIN])
        yield f"sft: final model in {run_sft(cfg, recipe_path=RECIPES / 'tiny-sft.yaml')}"
    if "grpo" in wanted:
        from rlkit.grpo.run import run_grpo

        cfg = load("grpo", RECIPES / "tiny-grpo.yaml", [
            f"model.path={out / 'sft' / 'final'}", f"data.train={data_dir / 'grpo_train.jsonl'}",
            f"data.eval={data_dir / 'grpo_eval.jsonl'}", f"output_dir={out / 'grpo'}", *AGAIN])
        final = run_grpo(cfg, recipe_path=RECIPES / "tiny-grpo.yaml")
        yield f"grpo: final policy in {final}; {_accuracy_line(out / 'grpo' / 'metrics.jsonl')}"
    ran = [out / stage for stage in ("sft", "grpo") if stage in wanted]
    if ran:
        from rlkit.plot import plot_runs

        curves = [p for p in plot_runs(ran, out / "plots") if p.name == "curves.png"]
        yield f"plots: {', '.join(str(p) for p in curves)} (and one PNG per panel beside each)"


def _accuracy_line(metrics: Path) -> str:
    """Held-out exact-answer accuracy at the first and last eval of a GRPO run."""
    import json

    rows = [json.loads(x) for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip()]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    if len(evals) < 2:
        return "no held-out evals"
    (s0, a0), (s1, a1) = evals[0], evals[-1]
    return f"held-out exact-answer accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
