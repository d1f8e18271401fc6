"""The suite on two workers (pytest-xdist, `-n 2` in pyproject's addopts): which tests run beside which.

- Each module is one unit of work, run on one worker (its module fixtures are built once), the
  modules with tests that start Ray, vLLM, DeepSpeed or a whole run (`slow`) first, in the suite's
  order, then the others, which are short and even out the two workers' ends. So two runs go at once:
  a run keeps about 1.4 of the two cores busy (it waits on its start-up, its actors and the network).
- A test marked `alone` reads or changes what the whole machine holds (the shared temporary folders,
  its processes): while it runs, from its fixtures' set-up to their tear-down, no other test does (a
  module's tests alone one after another hold the machine through, not once each).
- A session fixture that takes a run to build (`once`) is built by the first worker that needs it,
  in a folder both share; the other one waits for it, then reads it.

Without xdist (`-n 0`, or `-p no:xdist`) nothing here acts: the suite runs in its own order.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SHARED = "rlkit_workers"  # the workers' input: the folder of the lock files, which the controller made
FOLDER = pytest.StashKey[Path]()  # the controller's: that folder
Paths = Path | dict[str, Path]


def _worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _worker(config) and (config.getoption("numprocesses", None) or 0):
        config.stash[FOLDER] = Path(tempfile.mkdtemp(prefix="rlkit-test-workers-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if FOLDER in config.stash:
        shutil.rmtree(config.stash[FOLDER], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[SHARED] = str(node.config.stash[FOLDER])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the units in the order the workers collected them (below)
    return LoadScopeScheduling(config, log)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _heavy(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("alone") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, the modules with a heavy test first (both workers collect the same order)."""
    if not _worker(config):
        return
    heavy = {_module(item) for item in items if _heavy(item)}
    items.sort(key=lambda item: _module(item) not in heavy)


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


_HELD: list[contextlib.ExitStack] = []  # the worker's hold on the machine, kept across a module's run of tests alone


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test, its fixtures' set-up and tear-down included, holds the machine: shared, or alone. Tests
    alone that follow each other in a module keep it alone from the first one's set-up to the last one's
    tear-down: taken again for each, the other worker's test in between (a whole run, up to minutes)
    would park this worker once per test."""
    if not _worker(item.config):
        yield
        return
    if not _HELD:
        hold = contextlib.ExitStack()
        hold.enter_context(machine(Path(item.config.workerinput[SHARED]), alone=_alone(item)))
        _HELD.append(hold)
    try:
        yield
    finally:
        if not (_alone(item) and _alone(nextitem) and _module(nextitem) == _module(item)):
            _HELD.pop().close()


@contextlib.contextmanager
def machine(folder: Path, alone: bool) -> Iterator[None]:
    """A readers-writer lock over the workers, through two files in `folder`: a test alone takes the
    turnstile and keeps it while it waits for the other worker's test to end (no new one starts
    meanwhile), then holds the machine exclusively; any other test passes the turnstile and shares it."""
    with open(folder / "turnstile.lock", "a") as gate, open(folder / "machine.lock", "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Paths]) -> Paths:
    """`build(folder)`'s result, a path or a dict of paths, built once for the whole session: on two
    workers in the folder their own ones sit in (pytest's folder of the session), by whichever worker
    asks first while the other waits for it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(factory.mktemp(name))
    root = factory.getbasetemp().parent
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():  # the first to ask (or the second, where the first one's build failed)
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result = build(folder)
            done.write_text(json.dumps({"dict": result} if isinstance(result, dict) else {"path": result},
                                       default=str))
    saved = json.loads(done.read_text())
    return {k: Path(v) for k, v in saved["dict"].items()} if "dict" in saved else Path(saved["path"])
