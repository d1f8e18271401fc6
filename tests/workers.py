"""The suite on two workers (pytest-xdist, `-n 2` in pyproject's addopts): which tests run beside which.

- The tests that start Ray, vLLM, DeepSpeed or a whole run (`slow`) and those that must run `alone` go
  to one worker, one after another in the suite's order: two of them never run at once.
- The other worker takes every other test, a module at a time (a module's fixtures are built once).
- A test marked `alone` reads or changes what the whole machine holds (the shared temporary folders,
  its processes): while it runs, from its fixtures' set-up to their tear-down, no other test does.

The controller learns which tests are heavy from the workers' collection (markers are a worker's to
read): each worker writes the node ids of its `slow` and `alone` tests to a folder the controller made,
which also holds the lock files. Without xdist (`-n 0`, or `-p no:xdist`) nothing here acts.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HEAVY = "heavy"  # the scheduling unit of the tests that run one after another
SHARED = "rlkit_workers"  # the workers' input: the folder shared with the controller
FOLDER = pytest.StashKey[Path]()  # the controller's: that folder


def _folder(config: pytest.Config) -> Path | None:
    """The shared folder: the controller's own, or the one a worker was given (None without xdist)."""
    given = getattr(config, "workerinput", {}).get(SHARED)
    return Path(given) if given else config.stash.get(FOLDER, None)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and (config.getoption("numprocesses", None) or 0):
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

    class HeavyApart(LoadScopeScheduling):
        """LoadScopeScheduling whose scopes are the heavy tests (one unit: one worker, in order) and each
        other module."""

        heavy: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.heavy is None:  # the workers have collected by now: scheduling starts after
                self.heavy = {line for f in _folder(config).glob("heavy-*.txt") for line in f.read_text().splitlines()}
            return HEAVY if nodeid in self.heavy else nodeid.split("::", 1)[0]

    return HeavyApart(config, log)


def _heavy(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("alone") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    folder = _folder(config)
    if folder is not None and hasattr(config, "workerinput"):
        worker = config.workerinput["workerid"]
        (folder / f"heavy-{worker}.txt").write_text("".join(f"{item.nodeid}\n" for item in items if _heavy(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test, its fixtures' set-up and tear-down included, holds the machine: shared, or alone."""
    folder = _folder(item.config)
    if folder is None or not hasattr(item.config, "workerinput"):
        yield
        return
    with machine(folder, alone=item.get_closest_marker("alone") is not None):
        yield


@contextlib.contextmanager
def machine(folder: Path, alone: bool) -> Iterator[None]:
    """A readers-writer lock over the workers, through two files in `folder`: a test alone takes the
    turnstile and keeps it while it waits for the other worker's test to end (no new one starts
    meanwhile), then holds the machine exclusively; any other test passes the turnstile and shares it."""
    with open(folder / "turnstile", "a") as gate, open(folder / "machine", "a") as held:
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
