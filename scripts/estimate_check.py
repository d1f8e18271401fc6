"""rlkit estimate against measured memory, on this CPU host.

    OMP_NUM_THREADS=1 python scripts/estimate_check.py [--out /tmp/estimate-check] [--sizes tiny 25m]

For each tiny model size: a short `rlkit sft` (recipes/tiny-sft.yaml, data.cutoff_len 16: every
row is cut to 16 tokens, so a micro-batch is exactly 32 x 16 tokens) and a short `rlkit grpo`
(recipes/tiny-grpo.yaml from the untrained model, which writes all max_tokens). Each run logs its
processes' memory (`memory/learner_model_gib`, `memory/engine_model_gib`: the peak resident
memory less the process before its model or engine was built); the script prints them beside
`rlkit estimate` for the same recipe (GRPO's sequence length set to the longest prompt +
max_tokens, the length the run's batches had) and the ratio. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import rlkit  # noqa: E402


def measured(run: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(rows) if "memory/learner_model_gib" in r)


def estimated(stage: str, recipe: Path, overrides: list[str]) -> dict[str, float]:
    from rlkit import estimate, stages

    cfg = stages.load(stage, recipe, overrides)
    arch = estimate.Arch.from_config(*estimate.config_json(cfg.model.path))
    return {p.kind: p.total / 2**30 for p in estimate.estimate(cfg, stages.memory(stage), arch)}


def longest_prompt(model: Path, data: Path) -> int:
    from transformers import AutoTokenizer

    from rlkit.data.formats import load_prompts
    from rlkit.data.templates import render_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return max(len(tok(render_prompt(r, "alpaca", tok)).input_ids) for r in load_prompts(str(data)).rows)


def check(out: Path, sizes: list[str]) -> list[tuple[str, str, float, float]]:
    """(size, process, measured GiB, estimated GiB) for the SFT learner, the GRPO learner and engine."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        model, data = out / f"model-{size}", out / "data"
        rlkit("tiny-model", str(model), "--size", size, "--data", str(data), cwd=out)
        sft = [f"model.path={model}", f"data.train={data / 'sft_train.jsonl'}", "data.eval=null", "eval.every=0",
               "train.max_steps=4", "data.cutoff_len=16", f"output_dir={out / f'sft-{size}'}", "overwrite=true",
               "logging.progress=none"]
        rlkit("sft", str(ROOT / "recipes" / "tiny-sft.yaml"), *sft, cwd=out)
        m, e = measured(out / f"sft-{size}"), estimated("sft", ROOT / "recipes" / "tiny-sft.yaml", sft)
        rows.append((size, "sft learner", m["memory/learner_model_gib"], e["learner rank"]))
        grpo = [f"model.path={model}", f"data.train={data / 'grpo_train.jsonl'}", "data.eval=null", "eval.every=0",
                "grpo.steps=3", "checkpoint.every=0", f"output_dir={out / f'grpo-{size}'}", "overwrite=true",
                "logging.progress=none"]
        rlkit("grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), *grpo, cwd=out)
        length = longest_prompt(model, data / "grpo_train.jsonl") + 16  # + rollout.max_tokens
        m = measured(out / f"grpo-{size}")
        e = estimated("grpo", ROOT / "recipes" / "tiny-grpo.yaml", [*grpo, f"rollout.max_model_len={length}"])
        rows.append((size, "grpo learner", m["memory/learner_model_gib"], e["learner rank"]))
        rows.append((size, "grpo engine", m["memory/engine_model_gib"], e["rollout engine"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/estimate-check")
    p.add_argument("--sizes", nargs="+", default=["tiny", "25m"])
    args = p.parse_args()
    rows = check(Path(args.out), args.sizes)
    print(f"{'model':<6} {'process':<14} {'measured GiB':>13} {'estimate GiB':>13} {'estimate/measured':>18}")
    for size, kind, got, est in rows:
        print(f"{size:<6} {kind:<14} {got:>13.3f} {est:>13.3f} {est / got:>18.2f}")


if __name__ == "__main__":
    main()
