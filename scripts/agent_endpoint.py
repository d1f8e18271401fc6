"""The calculator task two ways: rlkit's own tool loop, and an agent program written with the
`openai` client talking to rlkit's OpenAI-compatible endpoint (rlkit.agent.examples:calculator):
the learning curves side by side (same seeds), the endpoint's cost per turn, forks.

    OMP_NUM_THREADS=1 python scripts/agent_endpoint.py --work /tmp/agent-endpoint [--steps 12] [--seeds 0 1]
        [--reuse]

Both runs start from the same model (scripts/tool_task.py's: SFT on the tool transcripts, then on
the mixed rows, so that it seldom calls the tool), sample with the same recipe and seeds, and score
with the same exact-answer reward; held-out exact accuracy every quarter. Prints per run the
held-out accuracy along the way, the train reward of the first and last steps, tool calls per
rollout, `time/generate` per step and per turn, the endpoint's own time per turn (rendering,
parsing, HTTP: `program/overhead_ms`) and forks per rollout; draws both with `rlkit plot` into
WORK/plots. Run nothing else meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import tool_task  # noqa: E402
from benchlib import rlkit  # noqa: E402

SHARED = ("rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0", "grpo.beta=0")
PROGRAM = ("rollout.program.fn=rlkit.agent.examples:calculator", "rollout.max_tokens=200", "rollout.max_model_len=512")


def run(mode: str, model: Path, data: dict[str, Path], work: Path, steps: int, seed: int) -> list[dict]:
    """GRPO on the calculator task with the `add` tool (`tools`) or the agent program (`program`)."""
    out = work / f"{mode}-seed{seed}"
    if mode == "tools":
        return tool_task.grpo(model, data, out, steps, 1e-4, seed, work, overrides=SHARED)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    rlkit("grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), f"model.path={model}", f"data.train={data['grpo_train']}",
          f"data.eval={data['grpo_eval']}", "data.build_synthetic_if_missing=null", "data.template=chat",
          "curriculum.enabled=false", "rewards=[{fn: 'rewards.exact:exact_match'}]", *PROGRAM, f"grpo.steps={steps}",
          "optim.lr=1e-4", f"eval.every={max(1, steps // 4)}", "checkpoint.every=0", f"output_dir={out}",
          "logging.progress=none", "logging.tensorboard=false", f"seed={seed}", *SHARED, cwd=work)
    return tool_task.metrics(out)


def summary(rows: list[dict]) -> dict[str, float | str]:
    steps = [r for r in rows if "reward/exact_match/mean" in r]
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    k = max(1, len(steps) // 4)
    turns = [r["tools/turns_mean"] * 64 for r in steps]  # 8 prompts x 8 per group
    gen = [r["time/generate"] for r in steps]
    return {"held-out exact": " -> ".join(f"{x:.3f}" for x in evals),
            "reward, first/last quarter": f"{statistics.mean(r['reward/exact_match/mean'] for r in steps[:k]):.3f} / "
                                          f"{statistics.mean(r['reward/exact_match/mean'] for r in steps[-k:]):.3f}",
            "tool calls per rollout, first/last quarter":
                f"{statistics.mean(r['tools/call_frequency'] for r in steps[:k]):.3f} / "
                f"{statistics.mean(r['tools/call_frequency'] for r in steps[-k:]):.3f}",
            "time/generate per step (median)": f"{statistics.median(gen):.2f} s",
            "time/generate per turn (median)": f"{1000 * statistics.median(g / t for g, t in zip(gen, turns)):.1f} ms",
            "endpoint time per turn (median)": f"{statistics.median(r['program/overhead_ms'] for r in steps):.2f} ms"
            if "program/overhead_ms" in steps[0] else "-",
            "forks per rollout": f"{statistics.mean(r['program/forks_mean'] for r in steps):.3f}"
            if "program/forks_mean" in steps[0] else "-"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--reuse", action="store_true", help="keep the SFT models of an earlier run in --work")
    args = ap.parse_args()

    from rlkit.tiny import build_tiny_model
    from rlkit.tiny_tools import write_tool_task

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "model", "tiny", tools=True)
    data = write_tool_task(work / "data")
    _, start = tool_task.tool_sft(model, data, work, tool_task.TOOL_STEPS, 120, args.reuse)
    table = {}
    for seed in args.seeds:
        for mode in ("tools", "program"):
            table[f"{mode}, seed {seed}"] = summary(run(mode, start, data, work, args.steps, seed))
    names = list(next(iter(table.values())))
    width = max(len(n) for n in names)
    print(f"calculator task, {args.steps} GRPO steps, 64 rollouts a step: rlkit's tool loop vs an openai-client "
          "program through the endpoint")
    for run_name, row in table.items():
        print(f"  {run_name}")
        for name in names:
            print(f"    {name:<{width}}  {row[name]}")
    rlkit("plot", *(str(work / f"{m}-seed{s}") for s in args.seeds for m in ("tools", "program")), "--out",
          str(work / "plots"), cwd=work)
    print(f"  curves: {work / 'plots'}")


if __name__ == "__main__":
    main()
