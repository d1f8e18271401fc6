"""A memory cgroup per sandboxed run, where the host delegates one: the run's processes, its
size-limited ``/tmp`` and ``/dev/shm`` and what they map together stay under one bound, which the
per-process address-space limit cannot give (four processes hold four times it).

`delegated()` finds the memory cgroup this process may make children in (cgroup v2 with the memory
controller, or v1's memory hierarchy) by making one; `Cap(limit)` is one run's child, `add(pid)`
moves a process and everything it has started into it (before the run is given its payload, so
nothing of the candidate's runs outside), `kill()` ends all that is in it (whatever session or
process group a process moved to), `close()` removes it (a child whose processes are still
being torn down by the kernel is removed at a later run, or when this process exits). Where none is
delegated (an ordinary user without systemd's delegation, most containers), `rlkit doctor` says so
and the bound is the per-process one.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import threading
import time

_count = itertools.count()
_stale: set[str] = set()  # children whose processes were still ending when their run closed
_lock = threading.Lock()


_probed: list[tuple[str, int] | None] = []
_probe_lock = threading.Lock()  # a sandbox's threads ask at once on a run's first batch


def delegated() -> tuple[str, int] | None:
    """(the folder of this process's memory cgroup, its cgroup version) where a child with a memory
    limit can be made there, else None. Probed once, by making and removing one."""
    with _probe_lock:
        if not _probed:
            _probed.append(_probe())
        return _probed[0]


def _probe() -> tuple[str, int] | None:
    for parent, version in _own_cgroups():
        probe = os.path.join(parent, f"rlkit-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            ok = _write(probe, ("memory.max",) if version == 2 else ("memory.limit_in_bytes",), 64 << 20)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
        if ok:
            return parent, version
    return None


def _own_cgroups() -> list[tuple[str, int]]:
    """This process's memory cgroup folders from /proc/self/cgroup and the mounts (v2 first)."""
    try:
        with open("/proc/self/cgroup") as f:
            mine = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for fields in mounts:
        sep = fields.index("-")
        root, point, fstype, opts = fields[3], fields[4], fields[sep + 1], fields[sep + 3].split(",")
        for _, controllers, path in mine:
            v2 = fstype == "cgroup2" and controllers == ""
            v1 = fstype == "cgroup" and "memory" in controllers.split(",") and "memory" in opts
            if (v2 or v1) and (path + "/").startswith(root.rstrip("/") + "/"):
                folder = os.path.join(point, path[len(root.rstrip("/")):].lstrip("/"))
                if not v2 or _has_memory(folder):
                    found.append((folder, 2 if v2 else 1))
    return sorted(found, key=lambda f: -f[1])


def _has_memory(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            return "memory" in f.read().split()
    except OSError:
        return False


def _write(folder: str, names: tuple[str, ...], value: int) -> bool:
    """Write ``value`` to the first of ``names`` the cgroup has (and to the others it has)."""
    done = False
    for name in names:
        with contextlib.suppress(OSError), open(os.path.join(folder, name), "w") as f:
            f.write(str(value))
            done = True
    return done


class Cap:
    """One run's memory cgroup: its processes and the memory files they hold, together, at most ``limit``
    bytes (None: no bound; the cgroup only gathers them, for `kill`)."""

    def __init__(self, limit: int | None) -> None:
        found = delegated()
        assert found is not None
        parent, self.version = found
        _sweep_stale()
        self.folder = os.path.join(parent, f"rlkit-{os.getpid()}-{next(_count)}")
        os.mkdir(self.folder)
        if limit is not None:
            names = ("memory.max", "memory.swap.max") if self.version == 2 else (
                "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
            _write(self.folder, names[:1], limit)
            _write(self.folder, names[1:], 0 if self.version == 2 else limit)  # no swap past the bound

    def add(self, pid: int) -> None:
        """Move ``pid`` and everything it started into the cgroup (parents first: what they start
        afterwards is born inside)."""
        todo = [pid]
        while todo:
            p = todo.pop()
            with contextlib.suppress(OSError), open(os.path.join(self.folder, "cgroup.procs"), "w") as f:
                f.write(str(p))
            todo += _children(p)

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.folder, "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> None:
        """End every process in it: those that left the run's session (a daemon it started with
        `setsid`) as well. A process sent SIGKILL can fork no more, so a pass that finds no process
        it has not signalled yet is the last (one whose fork finished before its kill is found by
        the next pass); the ones dying leave by themselves."""
        signalled: set[int] = set()
        while pids := set(self.pids()) - signalled:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            signalled |= pids

    def oom_killed(self) -> bool:
        """Whether the kernel killed one of its processes for its bound."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.folder, name)) as f:
                return any(line.split()[:1] == ["oom_kill"] and line.split()[1] != "0" for line in f)
        except (OSError, IndexError):
            return False

    def close(self) -> None:
        try:
            os.rmdir(self.folder)
        except OSError:  # its processes are still ending: removed later
            with _lock:
                _stale.add(self.folder)


def _children(pid: int) -> list[int]:
    kids = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
    return kids


@atexit.register
def _at_exit() -> None:
    """The children still ending when their runs closed: given a moment to end, then removed."""
    for _ in range(50):
        _sweep_stale()
        if not _stale:
            return
        time.sleep(0.02)


def _sweep_stale() -> None:
    with _lock:
        for folder in list(_stale):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            if not os.path.isdir(folder):
                _stale.discard(folder)
