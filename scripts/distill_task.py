"""The tiny distillation task end to end: does the student move toward the teacher?

    OMP_NUM_THREADS=1 python scripts/distill_task.py --work /tmp/distill-task [--reuse] [override ...]

1. the tiny model and the synthetic arithmetic task (`rlkit tiny-model`); `rlkit sft
   recipes/tiny-sft.yaml` for 600 steps (the teacher) and for 150 steps (the student);
2. `rlkit distill recipes/tiny-distill.yaml` from the student, with the overrides given (e.g.
   `distill.loss=reverse_kl distill.beta=1.0 optim.lr=1e-4 grpo.steps=300 grpo.prompts_per_step=16
   grpo.micro_batch_size=64`: the sampled reverse KL on the same number of samples);
3. on the held-out prompts (`grpo_eval.jsonl`, never distilled on): the exact per-token
   KL(student || teacher) over the vocabulary on the student's own greedy completions, and the
   share of those with the right number, before and after, and the teacher's share.
`--reuse` keeps the SFT models of an earlier run in --work. Run nothing else meanwhile (2 cores).
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


def held_out(model_dir: str | Path, teacher, rows: list[dict], tokenizer) -> tuple[float, float]:
    """(mean per-token KL(student || teacher) over the vocabulary on the student's own greedy
    completions, the share of those completions with the right number) on alpaca `rows` (HF, fp32,
    at most 16 new tokens); `teacher`: the teacher as an HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    from rewards.exact import parse_number
    from rlkit.data.templates import render_prompt

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kl, tokens, right = 0.0, 0, 0
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(render_prompt(row, "alpaca", tokenizer), return_tensors="pt").input_ids
            seq = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            start = ids.shape[1]
            right += parse_number(tokenizer.decode(seq[0, start:], skip_special_tokens=True)) == \
                parse_number(row["output"])
            log_s = torch.log_softmax(model(seq).logits[0, start - 1:-1].float(), -1)
            log_t = torch.log_softmax(teacher(seq).logits[0, start - 1:-1].float(), -1)
            kl += float((log_s.exp() * (log_s - log_t)).sum())
            tokens += seq.shape[1] - start
    return kl / tokens, right / len(rows)


def measure(student: Path, final: Path, teacher_dir: Path, eval_rows: Path) -> dict[str, float]:
    """`held_out` of the student before and after, and the teacher's share of right numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    rows = [json.loads(x) for x in eval_rows.read_text().splitlines() if x.strip()]
    kl_before, before = held_out(student, teacher, rows, tokenizer)
    kl_after, after = held_out(final, teacher, rows, tokenizer)
    return {"kl_before": kl_before, "kl_after": kl_after, "right_before": before, "right_after": after,
            "right_teacher": held_out(teacher_dir, teacher, rows, tokenizer)[1]}


def sft(model: Path, data: Path, out: Path, steps: int, work: Path) -> Path:
    rlkit("sft", str(ROOT / "recipes" / "tiny-sft.yaml"), f"model.path={model}", "model.build_tiny_if_missing=null",
          f"data.train={data / 'sft_train.jsonl'}", f"data.eval={data / 'sft_eval.jsonl'}",
          "data.build_synthetic_if_missing=null", f"train.max_steps={steps}", "eval.every=0", "checkpoint.every=0",
          f"output_dir={out}", "overwrite=true", "logging.progress=none", "logging.tensorboard=false", cwd=work)
    return out / "final"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--reuse", action="store_true", help="keep the SFT models of an earlier run in --work")
    ap.add_argument("overrides", nargs="*", help="distill recipe overrides (key.sub=value)")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, data = work / "model", work / "data"
    teacher, student = work / "teacher" / "final", work / "student" / "final"
    if not (args.reuse and teacher.is_dir() and student.is_dir()):
        rlkit("tiny-model", str(model), "--data", str(data), cwd=work)
        teacher = sft(model, data, work / "teacher", 600, work)
        student = sft(model, data, work / "student", 150, work)
    run = work / "distill"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    rlkit("distill", str(ROOT / "recipes" / "tiny-distill.yaml"), f"model.path={student}",
          f"distill.teacher.path={teacher}", f"data.train={data / 'sft_train.jsonl'}",
          f"data.eval={data / 'grpo_eval.jsonl'}", "data.build_synthetic_if_missing=null", f"output_dir={run}",
          "checkpoint.every=0", "logging.progress=none", "logging.tensorboard=false", *args.overrides, cwd=work)
    seconds = time.perf_counter() - t0
    m = measure(student, run / "final", teacher, data / "grpo_eval.jsonl")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    signal = next(k for k in ("train/distill/jsd", "train/distill/reverse_kl") if k in rows[-1])
    trained = [r[signal] for r in rows if signal in r]
    print(f"tiny distillation task ({' '.join(args.overrides) or 'recipes/tiny-distill.yaml as it is'}), "
          f"{len(trained)} steps in {seconds:.0f} s")
    print(f"  held-out KL(student || teacher) per token   {m['kl_before']:.3f} -> {m['kl_after']:.3f}")
    print(f"  held-out right numbers                      {m['right_before']:.3f} -> {m['right_after']:.3f} "
          f"(teacher {m['right_teacher']:.3f})")
    k = max(1, len(trained) // 10)
    print(f"  {signal:<43} first {k} steps {sum(trained[:k]) / k:.3f}, last {k} {sum(trained[-k:]) / k:.3f}")


if __name__ == "__main__":
    main()
