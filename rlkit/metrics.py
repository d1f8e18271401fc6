"""Metrics: JSONL in the run dir, TensorBoard events, wandb when installed, progress display."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rlkit.config import LoggingConfig


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


class MetricsLogger:
    """`log(step, metrics)` writes every sink; resuming drops records newer than the checkpoint."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, total_steps: int, start_step: int = 0,
                 config: dict | None = None, name: str = "rlkit"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.total, self.start = cfg, total_steps, start_step
        self.path = self.run_dir / "metrics.jsonl"
        kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._tb = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if cfg.wandb:
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.wandb_project, name=name, config=config, resume="allow")
            except ImportError:
                print("rlkit: logging.wandb is on but wandb is not installed; skipping it", file=sys.stderr)
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "plain"
        self._progress = self._task = None
        if mode == "bar":
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[info]}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task(name, total=total_steps, completed=start_step, info="")
        self._plain = mode == "plain"
        self._t0, self._s0 = time.time(), start_step

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _num(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and self._tb is not None:
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        self._display(step, record)

    def _display(self, step: int, record: dict[str, Any]) -> None:
        keys = [k for k in ("loss", "eval_loss", "reward", "lr", "tokens_per_s") if k in record]
        info = " ".join(f"{k}={record[k]:.4g}" for k in keys)
        done = step - self._s0
        eta = (time.time() - self._t0) / done * (self.total - step) if done > 0 else float("nan")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        elif self._plain and (step % self.cfg.every == 0 or step == self.total or "eval_loss" in record):
            print(f"step {step}/{self.total} {info} eta={eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
