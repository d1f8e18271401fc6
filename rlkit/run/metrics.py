"""Metrics: JSONL in the run dir, TensorBoard events, wandb when installed, progress display.

One naming scheme for both stages: every metric is `section/name` (`train/loss`, `train/lr`,
`eval/loss`, `eval/reward`, `eval/<reward fn>`, `reward/mean`, `reward/<fn>`, `time/step`,
`sync/mib`, ...); a JSONL record also carries `step` and `timestamp` (Unix seconds).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rlkit.config import LoggingConfig

# what the progress line shows, when the step has it
SHOWN = ("train/loss", "reward/mean", "train/lr", "train/tokens_per_s", "perf/mfu")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, one per "\n"-ended line: a completion's text may hold characters
    that `str.splitlines` also splits at (U+2028, U+0085, ...), which `json.dumps` leaves as they are."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").split("\n") if line.strip()]


class MetricsLogger:
    """`log(step, metrics)` writes every sink; resuming drops records newer than the checkpoint."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, total_steps: int, start_step: int = 0,
                 config: dict | None = None, name: str = "rlkit"):
        """`name`: the stage (the progress bar's label, the wandb job type); the wandb run is
        named after the run directory."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.total, self.start = cfg, total_steps, start_step
        self.path = self.run_dir / "metrics.jsonl"
        self._file = _reopen(self.path, start_step)
        self._samples = None  # rollouts.jsonl, opened by the first log_samples
        self._tb = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if cfg.wandb:
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.wandb_project, name=self.run_dir.resolve().name, job_type=name,
                                         config=config, dir=str(self.run_dir), resume="allow")
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
        unnamed = [k for k in metrics if "/" not in k]
        if unnamed:
            raise ValueError(f"metrics {unnamed} are not named section/name")
        values = {k: _num(v) for k, v in metrics.items()}
        record = {"step": step, "timestamp": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for k, v in values.items():
            if isinstance(v, (int, float)) and self._tb is not None:
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        self._display(step, values)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append `samples` (a step's example completions) to rollouts.jsonl, one line each."""
        if self._samples is None:
            self._samples = _reopen(self.run_dir / "rollouts.jsonl", self.start)
        stamp = round(time.time(), 3)
        for sample in samples:
            self._samples.write(json.dumps({"step": step, "timestamp": stamp, **sample}, ensure_ascii=False) + "\n")
        self._samples.flush()

    def _display(self, step: int, record: dict[str, Any]) -> None:
        """The progress line (bar or plain) and, when held-out metrics were computed, a line of them."""
        keys = [k for k in SHOWN if isinstance(record.get(k), (int, float))]
        info = " ".join(f"{k.split('/')[-1] if k.startswith(('train/', 'perf/')) else k}={record[k]:.4g}" for k in keys)
        evals = " ".join(f"{k}={v:.4g}" for k, v in record.items() if k.startswith("eval/") and
                         isinstance(v, (int, float)))
        done = step - self._s0
        eta = (time.time() - self._t0) / done * (self.total - step) if done > 0 else float("nan")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
            if evals:
                self._progress.console.print(f"step {step}/{self.total} held out: {evals}")
        elif self._plain:
            if info and (step % self.cfg.every == 0 or step == self.total):
                print(f"step {step}/{self.total} {info} eta={eta:.0f}s", file=sys.stderr, flush=True)
            if evals:
                print(f"step {step}/{self.total} held out: {evals}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()
        if self._samples is not None:
            self._samples.close()


def _reopen(path: Path, start_step: int) -> Any:
    """`path` (JSONL) open for appending, without the records after `start_step` (a resumed run
    writes its own)."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= start_step]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
