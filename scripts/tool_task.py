"""The calculator task end to end: does GRPO teach the model to use its tool?

    OMP_NUM_THREADS=1 python scripts/tool_task.py --work /tmp/tool-task [--sft-steps 400] [--tool-steps 400]
        [--mix-steps 120] [--grpo-steps 16] [--lr 1e-4] [--shaped 0.5] [--distill-student 320] [--distill-steps 120]
        [--reuse] [grpo.beta=0 ...]

On the tiny tool-calling model (rlkit/tiny.py; the task is rlkit/tiny_tools.py's `write_tool_task`:
sums of two 2-digit numbers, held-out pairs never seen in training):
1. SFT without the tool (`sft_direct.jsonl`: question -> answer: the no-tool baseline) and SFT on
   tool-use transcripts (`sft_tools.jsonl`: question -> a call of `add` -> its result -> the
   answer), `--sft-steps` and `--tool-steps`; then `--mix-steps` more SFT steps on
   `sft_mixed.jsonl` (the tool offered in every row, 30% of them transcripts, the rest answered
   directly): a model that can use the tool but seldom calls it, like a tool-trained model
   fine-tuned on plain chat data (`--mix-steps 0`: GRPO starts from the transcripts' model, which
   always calls);
2. GRPO from that model with `rollout.tools: [rlkit.tiny_tools:add]` and an exact-answer reward (with
   `--shaped W`, also `rlkit.tiny_tools:calculator_steps` at weight W: credit for the call's arguments
   and for repeating the tool's result);
3. held-out exact accuracy (greedy, the final assistant message) of each: the no-tool SFT model
   (`rlkit eval`), the tool SFT model (GRPO's step-0 eval), the GRPO policy every quarter of the
   run. Prints the table and the tool metrics of the GRPO run;
4. with `--distill-student N`: a student after N steps on the transcripts distils from the
   transcripts' SFT model with the tool in its rollouts (rlkit distill, TRL's JSD) for
   `--distill-steps`, and its held-out accuracy along the way.
Run nothing else meanwhile (2 cores). tests/e2e/test_calculator_task.py runs steps 1-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import rlkit  # noqa: E402

SFT_STEPS = 400  # on the direct answers: the no-tool baseline
# On the transcripts: at 400 both kinds of host CI runs on (AVX-512, AVX2) copy the numbers into the
# call and the tool's result into the answer (docs/tools.md).
TOOL_STEPS = 400
TOOL_ROLLOUT = ("rollout.tools=['rlkit.tiny_tools:add']", "rollout.max_tool_calls=2", "rollout.max_tokens=200",
                "rollout.max_model_len=512")


def sft(model: Path, data: Path, out: Path, steps: int, work: Path, lr: float = 3e-3, packing: bool = False) -> Path:
    """`rlkit sft` of `model` (the tiny model, or an SFT output) on chat rows `data` for `steps`
    steps, padded or `packing` (the same training, not the same time: on a CPU one packed row of
    a micro-batch's rows costs attention over all of it. Rows of a like length go faster padded,
    0.23 vs 0.32 s a step on the transcripts; the mixed rows, a third of them transcripts and the
    rest short, go faster packed, 0.14 vs 0.22 s); the final model."""
    rlkit("sft", str(ROOT / "recipes" / "tiny-sft.yaml"), f"model.path={model}", "model.build_tiny_if_missing=null",
          f"data.train={data}", "data.eval=null", "data.build_synthetic_if_missing=null", "data.template=chat",
          "data.cutoff_len=192", f"data.packing={str(packing).lower()}", "curriculum.enabled=false",
          f"train.max_steps={steps}", "eval.every=0", "checkpoint.every=0", f"output_dir={out}",
          "logging.progress=none", "logging.tensorboard=false", f"optim.lr={lr}", cwd=work)
    return out / "final"


def tool_sft(model: Path, data: dict[str, Path], work: Path, steps: int, mix_steps: int,
             reuse: bool = False) -> tuple[Path, Path]:
    """(the model SFT-trained on the transcripts for `steps`, that model after `mix_steps` more on
    the mixed rows at lr 1e-3, or the same model for 0); `reuse` keeps those already in `work`."""
    tools, mixed = work / "sft-tools" / "final", work / "sft-mixed" / "final"
    if not (reuse and tools.is_dir()):
        tools = sft(model, data["sft_tools"], work / "sft-tools", steps, work)
    if not mix_steps:
        return tools, tools
    if not (reuse and mixed.is_dir()):
        mixed = sft(tools, data["sft_mixed"], work / "sft-mixed", mix_steps, work, lr=1e-3, packing=True)
    return tools, mixed


def no_tool_baseline(model: Path, data: dict[str, Path], work: Path) -> float:
    """Held-out greedy exact accuracy of `model` answering without a tool (`rlkit eval`)."""
    report = json.loads(rlkit("eval", str(model), "--data", str(data["grpo_eval"]), "--rewards",
                              "rewards.exact:exact_match", "--template", "chat", "--max-tokens", "16", cwd=work))
    return report["rewards"]["exact_match"]


def grpo(model: Path, data: dict[str, Path], run: Path, steps: int, lr: float, seed: int, work: Path,
         shaped: float = 0.0, overrides: tuple[str, ...] = ()) -> list[dict]:
    """`rlkit grpo recipes/tiny-grpo.yaml` from `model` with the `add` tool and the exact-answer
    reward (+ `calculator_steps` at weight `shaped`), held-out eval every quarter; its metrics."""
    shutil.rmtree(run, ignore_errors=True)
    rewards = "rewards=[{fn: 'rewards.exact:exact_match'}" + (
        f", {{fn: 'rlkit.tiny_tools:calculator_steps', weight: {shaped}}}]" if shaped else "]")
    rlkit("grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), f"model.path={model}", f"data.train={data['grpo_train']}",
          f"data.eval={data['grpo_eval']}", "data.build_synthetic_if_missing=null", "data.template=chat",
          "curriculum.enabled=false", rewards, *TOOL_ROLLOUT, f"grpo.steps={steps}", f"optim.lr={lr}",
          f"eval.every={max(1, steps // 4)}", "checkpoint.every=0", f"output_dir={run}", "logging.progress=none",
          "logging.tensorboard=false", f"seed={seed}", *overrides, cwd=work)
    return metrics(run)


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS,
                    help="SFT steps on the direct answers (the no-tool baseline)")
    ap.add_argument("--tool-steps", type=int, default=TOOL_STEPS, help="SFT steps on the tool-use transcripts")
    ap.add_argument("--mix-steps", type=int, default=120,
                    help="then SFT steps on the mixed rows (0: GRPO starts from the transcripts' model)")
    ap.add_argument("--grpo-steps", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shaped", type=float, default=0.0,
                    help="weight of rlkit.tiny_tools:calculator_steps (credit for copying the numbers into the call "
                         "and the tool's result into the answer) beside the exact-answer reward; 0: exact answer only")
    ap.add_argument("--reuse", action="store_true", help="keep the SFT models of an earlier run in --work")
    ap.add_argument("--distill-student", type=int, default=0, metavar="STEPS",
                    help="also: a student with STEPS tool SFT steps distils from the tool SFT model (rlkit distill, "
                         "recipes/tiny-distill.yaml with the tools; 0: skip)")
    ap.add_argument("--distill-steps", type=int, default=120)
    ap.add_argument("overrides", nargs="*", help="more GRPO recipe overrides (key.sub=value)")
    args = ap.parse_args()

    from rlkit.tiny import build_tiny_model
    from rlkit.tiny_tools import write_tool_task

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "model", "tiny", seed=args.seed, tools=True)
    data = write_tool_task(work / "data", seed=args.seed)
    t0 = time.perf_counter()
    direct = work / "sft-direct" / "final"
    if not (args.reuse and direct.is_dir()):
        direct = sft(model, data["sft_direct"], work / "sft-direct", args.sft_steps, work)
    _, start = tool_sft(model, data, work, args.tool_steps, args.mix_steps, args.reuse)
    t1 = time.perf_counter()
    baseline = no_tool_baseline(direct, data, work)
    rows = grpo(start, data, work / "grpo", args.grpo_steps, args.lr, args.seed, work, args.shaped,
                tuple(args.overrides))
    t2 = time.perf_counter()
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    steps = [r for r in rows if "tools/call_frequency" in r]
    first, last = steps[:5], steps[-5:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    mix = f" + {args.mix_steps} on the mixed rows" if args.mix_steps else ""
    print(f"calculator task, {len(data['grpo_eval'].read_text().splitlines())} held-out sums, greedy exact answer "
          f"(tiny model, {args.sft_steps} SFT steps without the tool, {args.tool_steps} with it{mix}, "
          f"{args.grpo_steps} GRPO steps at lr {args.lr:g})")
    print(f"  no tool, SFT on direct answers           {baseline:.3f}")
    print(f"  tool offered, SFT                        {evals[0]:.3f}")
    print(f"  tool offered, SFT + GRPO                 {' -> '.join(f'{x:.3f}' for x in evals[1:])}")
    for name in ("tools/call_frequency", "tools/failure_frequency", "tools/turns_mean", "tools/masked_frac",
                 "reward/exact_match/mean"):
        print(f"  {name:<40} first 5 steps {mean(first, name):.3f}, last 5 steps {mean(last, name):.3f}")
    print(f"  time: SFT {t1 - t0:.0f} s, eval + GRPO {t2 - t1:.0f} s")
    if args.distill_student:
        distill(args, data, work)


def distill(args: argparse.Namespace, data: dict[str, Path], work: Path) -> None:
    """On-policy distillation with the tool: a student after fewer SFT steps on the transcripts
    samples (calls `add`, reads the result), the transcripts' SFT model is the teacher (TRL's JSD,
    forward KL)."""
    teacher, student = work / "sft-tools" / "final", work / "sft-student" / "final"
    if not (args.reuse and student.is_dir()):
        student = sft(work / "model", data["sft_tools"], work / "sft-student", args.distill_student, work)
    run = work / "distill"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    rlkit("distill", str(ROOT / "recipes" / "tiny-distill.yaml"), f"model.path={student}",
          f"distill.teacher.path={teacher}", f"data.train={data['grpo_train']}", f"data.eval={data['grpo_eval']}",
          "data.build_synthetic_if_missing=null", "data.template=chat", "rewards=[{fn: 'rewards.exact:exact_match'}]",
          *TOOL_ROLLOUT, f"grpo.steps={args.distill_steps}", "grpo.prompts_per_step=16",
          "grpo.micro_batch_size=64", f"eval.every={max(1, args.distill_steps // 4)}", "checkpoint.every=0",
          f"output_dir={run}", "logging.progress=none", "logging.tensorboard=false", f"seed={args.seed}", cwd=work)
    rows = metrics(run)
    evals = [f"{r['eval/exact_match']:.3f}" for r in rows if "eval/exact_match" in r]
    jsd = [r["train/distill/jsd"] for r in rows if "train/distill/jsd" in r]
    k = max(1, len(jsd) // 10)
    print(f"  tool, {args.distill_student} SFT steps on transcripts, distilled from the {args.tool_steps}-step model "
          f"({args.distill_steps} steps, {time.perf_counter() - t0:.0f} s): held-out exact {' -> '.join(evals)}")
    print(f"  {'train/distill/jsd':<40} first {k} steps {sum(jsd[:k]) / k:.3f}, last {k} steps {sum(jsd[-k:]) / k:.3f}")


if __name__ == "__main__":
    main()
