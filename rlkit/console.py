"""A quiet console: rlkit's own lines and one progress display; library output goes to the run's logs/.

- Actors: Ray starts each worker process of a run with `worker_process_setup_hook` pointing at
  `setup_worker`, which points the process's stdout and stderr (file descriptors 1 and 2, so C++
  warnings, progress bars and subprocesses go too) at `RUN_DIR/logs/worker-<pid>.log`; an actor
  names its file when it starts (`learner-0.log`, `engine-1.log`). The driver does not stream
  worker output (`log_to_driver=False`).
- The driver: the loggers of Ray, DeepSpeed, vLLM, transformers, ... and Python warnings go to
  `RUN_DIR/logs/driver.log` (what comes before the run folder is known is kept and written there).
- `RLKIT_VERBOSE=1` (`rlkit sft|grpo|demo --verbose`) leaves everything as the libraries print it,
  worker output streamed to the console by Ray.

Faults are not lost: rlkit says them in one line naming `rlkit.log`, whose detail (and these
logs) hold the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

VERBOSE_ENV = "RLKIT_VERBOSE"
LOG_DIR_ENV = "RLKIT_LOG_DIR"  # set for actors: where setup_worker writes
LIBRARIES = ("ray", "DeepSpeed", "deepspeed", "vllm", "transformers", "datasets", "accelerate", "peft", "torch",
             "huggingface_hub", "filelock", "urllib3", "py.warnings", "matplotlib")
_quiet = False  # set by quiet_driver: this process runs a command with a quiet console


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _LibraryLog(logging.Handler):
    """Library records of the driver: kept until the log file is known (a run's logs/driver.log, the
    engine log of `rlkit eval`), then written there."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.pending: list[str] = []
        self.file = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not worth a crash
            return
        if self.file is None:
            self.pending = (self.pending + [line])[-1000:]
        else:
            self.file.write(line)
            self.file.flush()

    def open(self, path: Path) -> None:
        if self.file is not None:
            self.file.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until the next run
        self.file.writelines(self.pending)
        self.file.flush()
        self.pending = []


_HANDLER = _LibraryLog()
PREFIX = "rlkit: "  # rlkit's log lines on a quiet console: told apart from anything else that gets there


class _LastResort(logging.Handler):
    """`logging.lastResort` of a quiet driver (records no handler took): rlkit's warnings print as
    `rlkit: ...`; a library's (Ray clears its own handlers in ray.init) go to logs/driver.log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] != "rlkit":
            _HANDLER.handle(record)
        elif record.levelno >= logging.WARNING:
            print(PREFIX + record.getMessage(), file=sys.stderr, flush=True)


class _ToLibraryLog(logging.Filter):
    """On a library logger: its own records go to the run's log instead of its handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        _HANDLER.handle(record)
        return False


def quiet_driver() -> None:
    """Send the libraries' driver-side logging and Python warnings to logs/driver.log (no-op when
    verbose). Called before the libraries are imported and again once Ray has started: a library
    that adds a console handler at import loses it here."""
    global _quiet
    if verbose():
        return
    _quiet = True
    logging.captureWarnings(True)
    logging.lastResort = _LastResort()
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ToLibraryLog) for f in logger.filters):
            logger.addFilter(_ToLibraryLog())  # records made on this logger itself (DeepSpeed's, at import)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)  # records made on its children (ray._private..., vllm.engine...)
        logger.propagate = False
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] in LIBRARIES:
            for h in list(logger.handlers):  # the console handlers the libraries added
                if type(h) is not logging.FileHandler and isinstance(h, logging.StreamHandler):
                    logger.removeHandler(h)
    _ray_errors_to_log()
    try:  # transformers and datasets draw tqdm bars without logging
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _ray_errors_to_log() -> None:
    """Ray's driver prints what the cluster publishes as errors ("(raylet) The node ... has been
    marked dead ...", a worker killed) on stdout from a thread of its own, log_to_driver or not.
    On a quiet console those lines go to logs/driver.log; rlkit says what happened in its line."""
    worker = sys.modules.get("ray._private.worker")
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "rlkit", False):
        return

    def to_log(data: dict, ignore_prefix: bool) -> None:
        if not _quiet or data.get("pid") != "raylet":
            return printer(data, ignore_prefix)
        for line in data.get("lines", []):
            logging.getLogger("ray").warning("(raylet) %s", line)

    to_log.rlkit = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_log


def quiet() -> bool:
    """Whether this process keeps the console to rlkit's lines (the CLI's run commands, not verbose)."""
    return _quiet and not verbose()


def driver_log(run_dir: Path) -> None:
    """The driver's library records go to run_dir/logs/driver.log from now on."""
    library_log(run_dir / "logs" / "driver.log")


def library_log(path: Path) -> None:
    """The driver's library records go to `path` from now on (on a quiet console)."""
    if quiet():
        quiet_driver()  # libraries imported since (vLLM configures its logger at import)
        _HANDLER.open(path)


def worker_runtime_env(log_dir: Path) -> dict:
    """Ray `runtime_env` fields for a run's actors: their output in log_dir (empty unless quiet)."""
    if not quiet():
        return {}
    log_dir.mkdir(parents=True, exist_ok=True)
    return {"worker_process_setup_hook": "rlkit.console.setup_worker",
            "env_vars": {LOG_DIR_ENV: str(log_dir.resolve())}}


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: this process's stdout / stderr go to logs/worker-<pid>.log."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return
    try:
        fd = os.open(os.path.join(log_dir, f"worker-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
    except OSError:  # a node that cannot write there keeps Ray's own worker logs
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def name_worker_log(name: str) -> None:
    """An actor's process names its log after itself: logs/worker-<pid>.log -> logs/<name>.log
    (<name>-<pid>.log when a restarted actor finds the name taken)."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return
    here = Path(log_dir) / f"worker-{os.getpid()}.log"
    target = Path(log_dir) / f"{name}.log"
    if target.exists():
        target = Path(log_dir) / f"{name}-{os.getpid()}.log"
    with contextlib.suppress(OSError):
        here.rename(target)


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2) go to `log` meanwhile, and its
    library logging from now on (an engine run in the driver, as `rlkit eval` does); a verbose
    console keeps them."""
    if verbose():
        yield
        return
    library_log(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
