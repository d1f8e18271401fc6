"""SFT end-to-end helpers: recipe overrides for tiny runs, metrics readers."""

from __future__ import annotations

import json
from pathlib import Path


def sft_overrides(tiny_model, task_data, out_dir, *extra: str) -> list[str]:
    return [f"model.path={tiny_model}", "model.build_tiny_if_missing=null", f"data.train={task_data['sft_train']}",
            f"data.eval={task_data['sft_eval']}", "data.build_synthetic_if_missing=null", f"output_dir={out_dir}",
            "logging.progress=none", "logging.tensorboard=false", *extra]


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def eval_losses(run_dir) -> list[float]:
    return [r["eval/loss"] for r in read_metrics(run_dir) if r.get("eval/loss") is not None]
