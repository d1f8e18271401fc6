"""A sandboxed run's pipes and its end: one select loop that feeds it its payload and reads what it
sends back up to a bound (`Exchange`), and the kill that leaves nothing of it running (`reap`)."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlkit.sandbox import uids

if TYPE_CHECKING:
    from rlkit.sandbox.cgroup import Cap


@dataclass(frozen=True)
class Started:
    """A sandboxed run under way: its process (bubblewrap's, or the program's), its working folder
    ("process" mode), the throwaway uid it drops to, its memory cgroup (None where none is delegated)."""

    proc: subprocess.Popen
    work: str | None = None
    uid: int | None = None
    cap: Cap | None = None


class Exchange:
    """One select loop over a run's pipes: feeds it the payload, keeps the first bytes of its stderr
    (the program points stderr elsewhere before it runs code) and reads its stdout up to a bound."""

    def __init__(self, proc: subprocess.Popen, payload: bytes, limit: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc, self.pending, self.limit = proc, memoryview(payload), limit
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.got = 0
        self.sel = selectors.DefaultSelector()
        os.set_blocking(proc.stdin.fileno(), False)
        self.sel.register(proc.stdout, selectors.EVENT_READ, self._stdout)
        self.sel.register(proc.stderr, selectors.EVENT_READ, self._stderr)
        if self.pending:
            self.sel.register(proc.stdin, selectors.EVENT_WRITE, self._stdin)
        else:
            proc.stdin.close()

    def until(self, deadline: float) -> tuple[bytes, bool, bool]:
        """(stdout, timed out, flooded): at EOF, at the deadline or past the bound."""
        try:
            while (left := deadline - time.perf_counter()) > 0:
                for key, _ in self.sel.select(left):
                    ended = key.data()
                    if ended is not None:
                        self._rest_of_stderr(min(deadline, time.perf_counter() + 1.0))
                        return ended
            return b"".join(self.out), True, False
        finally:
            self.sel.close()

    def _rest_of_stderr(self, until: float) -> None:
        """Stdout ended first: the process's last words (bubblewrap's refusal) may still be in the pipe."""
        err = self.proc.stderr
        while err.fileno() in self.sel.get_map() and (left := until - time.perf_counter()) > 0:
            if select.select([err], [], [], left)[0]:
                self._stderr()

    def _stdin(self) -> None:
        stdin = self.proc.stdin
        try:
            self.pending = self.pending[os.write(stdin.fileno(), self.pending[:65536]):]
        except OSError:  # it closed its stdin: the rest is not wanted
            self.pending = memoryview(b"")
        if not self.pending:
            self.sel.unregister(stdin)
            stdin.close()

    def _stderr(self) -> None:
        data = os.read(self.proc.stderr.fileno(), 4096)
        if not data or sum(map(len, self.err)) > 4096:
            self.sel.unregister(self.proc.stderr)
        else:
            self.err.append(data)

    def _stdout(self) -> tuple[bytes, bool, bool] | None:
        data = os.read(self.proc.stdout.fileno(), 65536)
        if not data:
            return b"".join(self.out), False, False
        self.out.append(data)
        self.got += len(data)
        if self.got > self.limit:
            return b"".join(self.out)[:self.limit], False, True
        return None


def reap(run: Started) -> None:
    """Kill a run's whole session (bubblewrap's init takes its PID namespace with it) and all that is
    in its memory cgroup, reap it, remove its working directory and its cgroup; in "process" mode as
    root, also whatever its throwaway uid still runs or left in the host's shared temporary folders."""
    proc, work, uid = run.proc, run.work, run.uid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            if f is not None:
                f.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    if run.cap is not None:
        run.cap.kill()  # what left its session ("process" mode; in namespaces bubblewrap's init took it)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        if uid is not None:
            sweep(uid)
    if run.cap is not None:
        run.cap.close()
    uids.release(uid)  # after its processes and leftovers are gone: another run may hold it now


def sweep(uid: int) -> None:
    """End the processes of a throwaway uid and remove what it owns in the shared temporary folders."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
            if next(int(line.split()[1]) for line in f if line.startswith("Uid:")) == uid:  # (/proc/PID: root's)
                os.kill(int(pid), signal.SIGKILL)
    for shared in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(OSError), os.scandir(shared) as entries:
            for e in entries:
                with contextlib.suppress(OSError):
                    if e.stat(follow_symlinks=False).st_uid == uid:
                        if e.is_dir(follow_symlinks=False):
                            shutil.rmtree(e.path, ignore_errors=True)
                        else:
                            os.unlink(e.path)
