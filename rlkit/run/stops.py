"""Stop signals: SIGTERM / SIGINT ask a run to stop at the end of the current step, after that
step's checkpoint (a driver asks `RunDir.checkpoint_due`, then `stop_if_signalled`); a second one
stops it at once. Either way the exit code says so (`EXIT_STOPPED`, or 128 + the signal)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlkit.errors import Stopped

log = logging.getLogger("rlkit")
EXIT_STOPPED = 3  # stopped by a signal after the checkpoint of the current step: rerun to resume


class StopSignals:
    """The stop signal a run got (`signal`, None until one came); `checkpointing`: whether the
    run writes checkpoints (the lines say what a rerun does)."""

    def __init__(self, checkpointing: bool):
        self.checkpointing = checkpointing
        self.signal: int | None = None

    @contextmanager
    def caught(self) -> Iterator[None]:
        """SIGTERM / SIGINT ask the run to stop at the end of the current step; a second one stops
        it at once. Enter it after Ray has started (Ray sets its own handler)."""
        def handler(signum: int, frame: Any) -> None:
            if self.signal is not None:
                raise Stopped(f"stopped by a second {signal.Signals(signum).name} during a step; rerun the same "
                              "command to resume from the last checkpoint", 128 + signum)
            self.signal = signum
            log.warning("%s: stopping after this step%s (send it again to stop at once)",
                        signal.Signals(signum).name, ", with a checkpoint" if self.checkpointing else "")

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def stop_if_signalled(self, step: int) -> None:
        """After a stop signal came: end the run after `step` (`Stopped`)."""
        if self.signal is None:
            return
        name = signal.Signals(self.signal).name
        if self.checkpointing:
            raise Stopped(f"stopped by {name} after step {step}; checkpoint step-{step} is written: rerun the "
                          "same command to resume", EXIT_STOPPED)
        raise Stopped(f"stopped by {name} after step {step}; no checkpoint is written (checkpoint.every: 0), "
                      "so a rerun starts over", EXIT_STOPPED)
