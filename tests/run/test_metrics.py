"""The metrics log: a resumed run drops the records after its checkpoint and appends after it;
one naming scheme, a timestamp per record, held-out metrics on the console."""

import time

import pytest

from rlkit.config import LoggingConfig
from rlkit.run.metrics import MetricsLogger, read_jsonl


def test_resume_truncates_records_after_the_checkpoint(tmp_path):
    cfg = LoggingConfig(tensorboard=True, progress="none")
    first = MetricsLogger(tmp_path, cfg, total_steps=6)
    for step in range(6):  # the run got to step 5, its last checkpoint was step 3
        first.log(step, {"train/loss": 10.0 - step, "train/nan": float("nan")})
    first.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]

    resumed = MetricsLogger(tmp_path, cfg, total_steps=6, start_step=3)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    resumed.log(4, {"train/loss": 0.5})
    resumed.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["train/loss"] == 0.5 and rows[0]["train/nan"] is None  # non-finite values are written as null
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_every_metric_is_section_slash_name_with_a_timestamp(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, progress="plain", every=10), total_steps=20)
    before = round(time.time() - 0.001, 3)
    logger.log(5, {"train/loss": 1.5, "reward/mean": 0.25})
    logger.log(10, {"train/loss": 1.0, "eval/loss": 0.75, "eval/exact_match": 0.5})
    with pytest.raises(ValueError, match=r"metrics \['loss'\] are not named section/name"):
        logger.log(11, {"loss": 1.0})
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [set(r) for r in rows] == [{"step", "timestamp", "train/loss", "reward/mean"},
                                      {"step", "timestamp", "train/loss", "eval/loss", "eval/exact_match"}]
    assert before <= rows[0]["timestamp"] <= rows[1]["timestamp"] <= time.time() + 0.001
    err = capsys.readouterr().err.splitlines()
    # step 5 is not a logging step (logging.every 10); step 10 is, and shows its held-out metrics
    assert len(err) == 2 and err[0].startswith("step 10/20 loss=1 eta=")
    assert err[1] == "step 10/20 held out: eval/loss=0.75 eval/exact_match=0.5"


def test_every_logged_metric_of_both_stages_is_in_the_scheme():
    """The metrics the drivers build (sft/run.py _step_metrics, grpo/run.py _step_metrics) are named
    section/name; the logger refuses anything else, so an e2e run checks the rest."""
    from rlkit.grpo.run import _step_metrics as grpo_metrics
    from rlkit.learner.objective import StepMetrics
    from rlkit.sft.run import _step_metrics as sft_metrics

    result = StepMetrics({"tokens": 4, "nll": 2.0}, 1, 0.5, 1e-3, seconds=1.5, tokens=3, flops=3e9, peak_flops=1e10)
    sft = sft_metrics([result], [{"input_ids": [1, 2, 3]}], 2.0, {"explain": 1.0})
    assert sft["train/loss"] == 0.5 and sft["time/step"] == 2.0 and sft["mix/explain"] == 1.0
    assert sft["perf/tokens_per_s"] == 2.0 and sft["perf/mfu"] == pytest.approx(0.2)  # the learner's own seconds
    fit = type("F", (), {"steps": [result], "logprob_seconds": 0.1})()
    import time

    t0 = time.perf_counter() - 10.0  # a 10 s step; engines 0 and 1 generated 1 s and 3 s of it, engine 2 nothing
    grpo = grpo_metrics([fit], 8, {"bytes": 2**20}, t0, t0 + 5, t0 + 9, {0: 1.0, 1: 3.0}, 3)
    assert all("/" in k for k in [*sft, *grpo]) and grpo["sync/mib"] == 1.0 and "train/samples_per_s" in grpo
    assert grpo["perf/mfu"] == pytest.approx(0.2)
    assert grpo["rollout/busy_fraction"] == pytest.approx(4 / 30, abs=1e-3) and grpo["rollout/busy_fraction_min"] == 0
    assert "rollout/busy_fraction" not in grpo_metrics([fit], 8, {"bytes": 1}, t0, t0, t0, {}, 3)  # restored samples


def test_the_wandb_run_is_named_after_the_output_dir(tmp_path, monkeypatch):
    """wandb is not installed here (and has no server): a stand-in module records what rlkit asks of it."""
    import sys
    import types

    calls = {}
    run = types.SimpleNamespace(log=lambda values, step: calls.setdefault("logged", []).append((step, values)),
                                finish=lambda: calls.setdefault("finished", True))
    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "qwen-lora-run3"
    logger = MetricsLogger(out, LoggingConfig(tensorboard=False, wandb=True, progress="none"), total_steps=2,
                           config={"seed": 1}, name="grpo")
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert calls["init"]["name"] == "qwen-lora-run3" and calls["init"]["job_type"] == "grpo"
    assert calls["init"]["project"] == "rlkit" and calls["init"]["config"] == {"seed": 1}
    assert calls["logged"] == [(1, {"reward/mean": 0.5})] and calls["finished"]


def test_a_completion_holding_a_unicode_line_separator_reads_back(tmp_path):
    """rollouts.jsonl holds model text as it is (`ensure_ascii=False`): U+2028 and U+0085, which
    `str.splitlines` splits at, stay inside their record (a resumed run read it back as two halves)."""
    import json

    from rlkit.run.metrics import read_jsonl

    path = tmp_path / "rollouts.jsonl"
    records = [{"step": 1, "completion": "a\u2028b\x85c"}, {"step": 2, "completion": "d"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert read_jsonl(path) == records
