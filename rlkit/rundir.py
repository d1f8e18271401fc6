"""`output_dir` of one run, as every stage driver keeps it: the resolved recipe (config.yaml),
rlkit.log, atomic checkpoints and what to resume from, the metrics logger, final/.

Inside `RunDir.session()` a fault (`FaultError`: an actor died or hung, a full disk) ends the
run with one line that says which checkpoint a rerun resumes from, Ray's detail going to
rlkit.log; inside `RunDir.stop_on_signals()` SIGTERM / SIGINT stop the run at the end of the
current step, after a checkpoint (`checkpoint_due`, `stop_if_signalled`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rlkit import console, faults, reruns
from rlkit.checkpoint import CheckpointManager, dir_bytes, resolve_resume
from rlkit.config import CheckpointConfig
from rlkit.data.curriculum import CurriculumSampler
from rlkit.errors import FaultError, Stopped, UserError
from rlkit.recipe import to_dict

if TYPE_CHECKING:
    from rlkit.engine.group import LearnerGroup

log = logging.getLogger("rlkit")
PAYLOAD_FILE = "driver_payload.pt"
LOG_FILE = "rlkit.log"
EXIT_STOPPED = 3  # stopped by a signal after the checkpoint of the current step: rerun to resume
FULL_BELOW = 64 << 20  # free bytes under which a failed write is put down to a full disk


def ship_template(model_dir: Path, template: str) -> None:
    """Write the prompt template a model was trained with into its tokenizer (chat_template), so
    that serving it with a chat API renders the prompts it learned (the alpaca template; a chat
    template is the tokenizer's own already)."""
    from transformers import AutoTokenizer

    from rlkit.data.templates import chat_template_for

    if not (Path(model_dir) / "tokenizer_config.json").exists():
        return  # no tokenizer was saved with this model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jinja = chat_template_for(template, tokenizer)
    if jinja is not None:
        tokenizer.chat_template = jinja
        tokenizer.save_pretrained(model_dir)


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
        self.stop_signal: int | None = None
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

    def resume(self, learners: LearnerGroup, sampler: CurriculumSampler) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint to resume from (if any) into the learners and the sampler; returns
        its step (0 when starting fresh) and the driver state it saved."""
        if self.resume_from is None:
            return 0, {}
        learners.load_checkpoint(self.resume_from)
        saved = CheckpointManager.load_state(self.resume_from)
        sampler.load_state_dict(saved["sampler"])
        log.warning("resumed from %s (step %d)", self.resume_from, saved["step"])
        return saved["step"], saved.get("driver", {})

    def resume_payload(self) -> Any:
        """The driver payload of the checkpoint to resume from (None without one)."""
        if self.resume_from is None or not (self.resume_from / PAYLOAD_FILE).exists():
            return None
        import torch

        return torch.load(self.resume_from / PAYLOAD_FILE, weights_only=True)

    def checkpoint(self, step: int, learners: LearnerGroup, sampler_state: dict, driver: dict | None = None,
                   protect: set[int] = frozenset(), payload: Any = None) -> None:
        """An atomic checkpoint after `step`: learner states, then the sampler and driver state.
        `sampler_state` is the sampler as the next step will find it; `payload` (plain containers
        of tensors, numbers and strings: e.g. rollouts in flight) goes beside them. A write that
        fails leaves the earlier checkpoints as they were (a full disk: a `FaultError`)."""
        latest = self.ckpts.latest()
        staging = self.ckpts.staging_dir(step)
        with self._writing(staging, f"checkpoint step {step}", dir_bytes(latest) if latest else None):
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
        with self._writing(staging, "the final save", needed):
            learners.save_model(staging, tokenizer_dir)
            ship_template(staging, self.template)
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(staging, self.final)
        return self.final

    @contextmanager
    def _writing(self, staging: Path, what: str, needed: int | None) -> Iterator[None]:
        """Remove `staging` if the writes inside fail; a full disk becomes a one-line `FaultError`
        naming the path and the bytes `what` needs (`needed`, else at least what it wrote)."""
        try:
            yield
        except BaseException as e:
            written = dir_bytes(staging)
            shutil.rmtree(staging, ignore_errors=True)
            if not isinstance(e, Exception) or not _disk_full(e, staging):
                raise
            free = shutil.disk_usage(_existing(staging)).free
            need = (f"about {_size(needed)}" if needed else f"more than {_size(written)}") + f", {_size(free)} free"
            raise FaultError(f"{what}: the disk is full under {staging.parent} (it needs {need}): "
                             "free some space") from e

    def checkpoint_due(self, step: int, every: int, also: bool = False) -> bool:
        """Whether to checkpoint after `step`: every `every` steps, when `also`, or when a stop
        signal came during the step (and checkpointing is on)."""
        faults.crash_here("step", "driver")
        return bool(every and step % every == 0) or also or (self.stop_signal is not None and self.checkpointing)

    def stop_if_signalled(self, step: int) -> None:
        """After a stop signal came (`stop_on_signals`): end the run after `step` (`Stopped`)."""
        if self.stop_signal is None:
            return
        name = signal.Signals(self.stop_signal).name
        if self.checkpointing:
            raise Stopped(f"stopped by {name} after step {step}; checkpoint step-{step} is written: rerun the "
                          "same command to resume", EXIT_STOPPED)
        raise Stopped(f"stopped by {name} after step {step}; no checkpoint is written (checkpoint.every: 0), "
                      "so a rerun starts over", EXIT_STOPPED)

    @contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT ask the run to stop at the end of the current step (`stop_if_signalled`); a
        second one stops it at once. Enter it after Ray has started (Ray sets its own handler)."""
        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:
                raise Stopped(f"stopped by a second {signal.Signals(signum).name} during a step; rerun the same "
                              "command to resume from the last checkpoint", 128 + signum)
            self.stop_signal = signum
            log.warning("%s: stopping after this step%s (send it again to stop at once)",
                        signal.Signals(signum).name, ", with a checkpoint" if self.checkpointing else "")

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

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
        from rlkit.metrics import MetricsLogger

        return MetricsLogger(self.path, logging_cfg, total_steps, start_step=start_step, config=self.config,
                             name=self.stage)


def _disk_full(error: BaseException, path: Path) -> bool:
    """Whether `error` (raised writing under `path`) came from a full disk: ENOSPC / EDQUOT in its
    chain (through Ray task errors too), or almost no space left where it wrote. torch.save on a
    full disk raises a RuntimeError ("unexpected pos ...") with no errno, hence the second test."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    return shutil.disk_usage(_existing(path)).free < FULL_BELOW


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
