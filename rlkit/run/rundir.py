"""`output_dir` of one run, as every stage driver keeps it: the resolved recipe (config.yaml),
rlkit.log, checkpoints and what to resume from, the metrics logger, final/.

Inside `RunDir.session()` a fault (`FaultError`: an actor died or hung, a full disk) ends the
run with one line that says which checkpoint a rerun resumes from, Ray's detail going to
rlkit.log; inside `run.stops.caught()` SIGTERM / SIGINT stop the run at the end of the current
step, after a checkpoint (`checkpoint_due`, then `run.stops.stop_if_signalled`: `rlkit.run.stops`).
How a checkpoint is written, verified and read back, and what a full disk says, is
`rlkit.run.checkpoint`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rlkit import console, faults
from rlkit.config import CheckpointConfig
from rlkit.data.curriculum import CurriculumSampler
from rlkit.data.templates import ship_template
from rlkit.errors import FaultError, UserError
from rlkit.recipe import to_dict
from rlkit.run import reruns
from rlkit.run.checkpoint import (
    PAYLOAD_FILE,
    CheckpointManager,
    Resumed,
    dir_bytes,
    read_resume,
    resolve_resume,
    writing,
)
from rlkit.run.stops import StopSignals

if TYPE_CHECKING:
    from rlkit.learner.group import LearnerGroup

log = logging.getLogger("rlkit")
LOG_FILE = "rlkit.log"


class RunDir:
    """`output_dir` of one run: the resolved recipe (config.yaml), checkpoints, metrics, final/."""

    def __init__(self, cfg: Any, stage: str, template: str = "alpaca"):
        self.path = Path(cfg.output_dir)
        self.template = template  # the prompt template trained (data.template resolved): final/ ships it
        self.stage, self.config = stage, to_dict(cfg)
        self.config_text = yaml.safe_dump({"stage": stage, **self.config}, sort_keys=False, allow_unicode=True)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / LOG_FILE).touch()
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"output_dir: {self.path} (or a folder above it) is a file, not a directory; "
                            "choose another output_dir") from None
        except PermissionError as e:
            raise UserError(f"output_dir: cannot write in {self.path} ({e.strerror}: {e.filename}); "
                            "choose another output_dir") from None
        checkpoint: CheckpointConfig = cfg.checkpoint
        self.checkpointing = checkpoint.every > 0
        self.ckpts = CheckpointManager(self.path / "checkpoints", checkpoint.keep_last)
        self.stops = StopSignals(self.checkpointing)
        with self._log_file():
            self.resume_from = resolve_resume(self.ckpts, checkpoint.resume)
            current = yaml.safe_load(self.config_text)
            if self.resume_from is not None:
                reruns.check_resume(self.resume_from, self.path, current, type(cfg).RESUME_FIXED,
                                    checkpoint.force_resume)
            else:
                reruns.check_fresh_start(self.path, current, cfg.overwrite)
        (self.path / reruns.CONFIG_FILE).write_text(self.config_text, encoding="utf-8")
        console.driver_log(self.path)

    def announce(self, line: str) -> None:
        """A line the console shows before training (the run's plan), also in rlkit.log."""
        with self._log_file():
            log.info("%s", line)
        print(line, file=sys.stderr, flush=True)

    @property
    def final(self) -> Path:
        return self.path / "final"

    def resume(self, learners: LearnerGroup, sampler: CurriculumSampler) -> Resumed:
        """Load the checkpoint to resume from (if any) into the learners and the sampler; what it
        holds for the driver (`Resumed`: step 0 when starting fresh)."""
        resumed = read_resume(self.resume_from)
        if self.resume_from is not None:
            learners.load_checkpoint(self.resume_from)
            sampler.load_state_dict(resumed.sampler)
            log.warning("resumed from %s (step %d)", self.resume_from, resumed.step)
        return resumed

    def checkpoint(self, step: int, learners: LearnerGroup, sampler_state: dict, driver: dict | None = None,
                   protect: set[int] = frozenset(), payload: Any = None) -> None:
        """An atomic checkpoint after `step`: learner states, then the sampler and driver state.
        `sampler_state` is the sampler as the next step will find it; `payload` (plain containers
        of tensors, numbers and strings: e.g. rollouts in flight) goes beside them. A write that
        fails leaves the earlier checkpoints as they were (a full disk: a `FaultError`)."""
        latest = self.ckpts.latest()
        staging = self.ckpts.staging_dir(step)
        with writing(staging, f"checkpoint step {step}", dir_bytes(latest) if latest else None):
            learners.save_checkpoint(staging)
            faults.crash_here("checkpoint", "driver")
            if payload is not None:
                import torch

                torch.save(payload, staging / PAYLOAD_FILE)
            (staging / reruns.CONFIG_FILE).write_text(self.config_text, encoding="utf-8")
            self.ckpts.commit(staging, step, {"sampler": sampler_state, "template": self.template,
                                              **({"driver": driver} if driver else {})}, protect)

    def save_final(self, learners: LearnerGroup, tokenizer_dir: str, needed: int | None = None) -> Path:
        """The final model, written beside `final/` and renamed into place, so a failed save
        (`needed`: its expected bytes, for the full-disk message) leaves no half model."""
        staging = self.path / ".tmp-final"
        shutil.rmtree(staging, ignore_errors=True)
        with writing(staging, "the final save", needed):
            learners.save_model(staging, tokenizer_dir)
            ship_template(staging, self.template)
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(staging, self.final)
        return self.final

    def checkpoint_due(self, step: int, every: int, also: bool = False) -> bool:
        """Whether to checkpoint after `step`: every `every` steps, when `also`, or when a stop
        signal came during the step (`stops`; and checkpointing is on)."""
        faults.crash_here("step", "driver")
        return bool(every and step % every == 0) or also or (self.stops.signal is not None and self.checkpointing)

    @contextmanager
    def session(self) -> Iterator[None]:
        """The run's life: the log file, and faults as one line naming the checkpoint to resume
        from (the detail in rlkit.log)."""
        with self._log_file():
            try:
                yield
            except FaultError as e:
                log.info("the fault in detail:", exc_info=e)
                if (self.path / "logs").is_dir():
                    log.info("each actor's own output (and the libraries' driver-side log): %s", self.path / "logs")
                latest = self.ckpts.latest()
                then = (f"the newest checkpoint, {latest.name}, is intact: rerun the same command to resume from it"
                        if latest else "no checkpoint was written yet, so a rerun starts over")
                raise FaultError(f"{e}; {then} (details: {self.path / LOG_FILE})") from None

    @contextmanager
    def _log_file(self) -> Iterator[None]:
        """rlkit's log records (INFO and up) also go to `output_dir/rlkit.log`; when nothing else
        shows them, warnings still go to stderr as they did before."""
        handlers = [logging.FileHandler(self.path / LOG_FILE, encoding="utf-8")]
        handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers[0].setLevel(logging.INFO)
        if not log.handlers and not logging.getLogger().handlers:
            handlers.append(logging.StreamHandler())
            handlers[1].setLevel(logging.WARNING)
            if console.quiet():
                handlers[1].setFormatter(logging.Formatter(console.PREFIX + "%(message)s"))
        level = log.level
        log.setLevel(min(level or logging.WARNING, logging.INFO))
        for h in handlers:
            log.addHandler(h)
        try:
            yield
        finally:
            for h in handlers:
                log.removeHandler(h)
                h.close()
            log.setLevel(level)

    def logger(self, logging_cfg: Any, total_steps: int, start_step: int) -> Any:
        """Metrics sinks (JSONL, TensorBoard, wandb, progress); records after `start_step` are dropped."""
        from rlkit.run.metrics import MetricsLogger

        return MetricsLogger(self.path, logging_cfg, total_steps, start_step=start_step, config=self.config,
                             name=self.stage)
