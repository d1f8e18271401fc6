"""The metrics log: a resumed run drops the records after its checkpoint and appends after it."""

from rlkit.config import LoggingConfig
from rlkit.metrics import MetricsLogger, read_jsonl


def test_resume_truncates_records_after_the_checkpoint(tmp_path):
    cfg = LoggingConfig(tensorboard=True, progress="none")
    first = MetricsLogger(tmp_path, cfg, total_steps=6)
    for step in range(6):  # the run got to step 5, its last checkpoint was step 3
        first.log(step, {"loss": 10.0 - step, "nan": float("nan")})
    first.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]

    resumed = MetricsLogger(tmp_path, cfg, total_steps=6, start_step=3)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    resumed.log(4, {"loss": 0.5})
    resumed.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["loss"] == 0.5 and rows[0]["nan"] is None  # non-finite values are written as null
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
