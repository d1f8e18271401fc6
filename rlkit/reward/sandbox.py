"""Run untrusted code walled off by the kernel; what comes back is data for a judge outside.

`Sandbox(isolation, limits, url).run(program, payload)` starts ``python -I -S -c program`` with
``payload`` on its stdin and returns what it wrote on stdout (bounded), whether it timed out or
flooded, and how long it took. Nothing else of the caller reaches the program.

Isolation (``isolation``):
* ``"namespaces"`` (the default): bubblewrap (``bwrap``, Debian's ``bubblewrap`` package) puts the
  program in new user (when not root), mount, PID, network, IPC, UTS and cgroup namespaces: an
  empty root with only ``/usr``, the interpreter's prefix and the loader cache mounted read-only,
  a fresh ``/proc`` and ``/dev``, a size-limited scratch ``/tmp`` (its working directory) and
  ``/dev/shm``, no environment but ``PATH``/``HOME``/``LANG``, a loopback of its own and no other
  interface, its own session, no capabilities. The driver's files, environment, sockets (TCP,
  Unix and abstract) and processes do not exist there; everything it writes lives in memory that
  the kernel frees with the namespaces when the run ends (SysV IPC with its IPC namespace). As root,
  bubblewrap runs without a user namespace and the program drops to a throwaway uid of its own
  before anything else, so its process limit is enforced (the kernel does not enforce one for root).
  A seccomp filter (`rlkit.reward.seccomp`) denies the kernel keyring, new namespaces and mounts, memory
  files, ptrace, eBPF, perf events, io_uring and the like; without root bubblewrap also forbids
  nested user namespaces. The root and ``/dev`` are read-only: ``/tmp`` and ``/dev/shm`` are all
  it can write.
* ``"remote"``: an HTTP execution service with SandboxFusion's ``POST /run_code`` API (what verl
  uses): the same program and payload go to ``url``; its stdout comes back (bounded) and the judge
  compares here as it does locally. The service's walls are its own.
* ``"process"``: a weaker mode a recipe must ask for, for hosts whose kernel refuses namespaces:
  a child process in its own session with the same limits, a clean environment and a throwaway
  working directory; the program loads the seccomp filter itself, with no sockets, no signals
  outside its own process group, no new session or group and no SysV IPC on top, and as root drops
  to a throwaway uid (importing through folders it opened first); afterwards that uid's processes
  are ended and what it left at the top of the shared temporary folders removed. It does not hide
  files every user may read or write, nor, without root, the driver user's own files
  (docs/rewards.md has the table of what each mode guarantees).

Limits in the local modes: wall clock (the whole sandbox is killed), CPU seconds, address space,
processes, open files, file size, no core dumps, and the bytes it may send back.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from rlkit.errors import RewardError
from rlkit.reward import cgroup, seccomp, uids
from rlkit.reward.pipes import Exchange, Started, reap, sweep

ISOLATIONS = ("namespaces", "remote", "process")
# the program's whole environment (HOME: its working directory), in both local modes
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use.

    timeout_s: wall clock of the run (CPU limit: ceil(timeout_s) + 1 s). memory_mb: address space
    of each process. max_procs: processes and threads (with the first one). scratch_mb: the
    writable ``/tmp`` and ``/dev/shm`` (each; "namespaces" only), and the largest file it may
    write. output_kb: bytes it may send back; more, and it is killed (flooded).
    """

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_procs: int = 4
    scratch_mb: int = 64
    output_kb: int = 1024

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": math.ceil(self.timeout_s) + 1, "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_FSIZE": self.scratch_mb << 20, "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0,
                "RLIMIT_NPROC": self.max_procs}


@dataclass(frozen=True)
class Outcome:
    """What came back from one run: stdout (at most ``output_kb``), and how it ended."""

    stdout: bytes
    timed_out: bool
    flooded: bool
    seconds: float
    stderr: str = ""  # what the sandbox itself said before the program took over (its first 2 KB)


def interpreter() -> str:
    """The Python the sandbox runs: this process's base interpreter (a venv's ``bin/python`` is a
    link to it; the sandbox runs with ``-I -S``, the standard library only)."""
    exe = os.path.realpath(sys.executable)
    return exe if os.path.isfile(exe) else sys.executable


def running_as_root() -> bool:
    return os.geteuid() == 0


@functools.cache
def undumpable() -> None:
    """"process" mode without root: the candidate runs as this process's uid, and a process may read and
    write another of its uid's memory and descriptors through /proc (`/proc/PID/mem`, `/proc/PID/fd/N`)
    unless that one is undumpable: this process (the driver's side of a sample) becomes so. Its own
    /proc files are then root's: its user's debuggers and `py-spy` cannot attach to it either. As root
    the candidate has a uid of its own: nothing to do. Once a process (the flag holds until an exec or
    a change of uid, neither of which the driver's side makes; a fork keeps it, as it keeps this cache)."""
    if not running_as_root():
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0 (until the next exec: children start dumpable)


def next_uid() -> int:
    """A throwaway uid for one run as root, held by no other run on this host until its run is reaped
    (`rlkit.reward.uids`)."""
    return uids.claim(sweep)


@functools.lru_cache(maxsize=16)
def bwrap_args(python: str, limits: Limits) -> tuple[str, ...]:
    """bubblewrap's command line: the namespaces and the read-only view described above (the same
    for every run with these limits: built once)."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    size = str(limits.scratch_mb << 20)
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
    if running_as_root():  # no user namespace: keep what the program needs to drop to its throwaway uid
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # and no user namespace of its own inside it
        args += ["--unshare-user", "--disable-userns"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(python))
    if not prefix.startswith("/usr/") and prefix != "/usr":
        parts = prefix.strip("/").split("/")
        for i in range(1, len(parts)):  # the folders above the prefix: traversable by anyone inside
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm", "--symlink", "/tmp", "/var/tmp",
             "--chdir", "/tmp",
             "--remount-ro", "/dev", "--remount-ro", "/"]  # bubblewrap's own tmpfs: writable to a user's sandbox
    for k, v in {**_ENV, "HOME": "/tmp"}.items():
        args += ["--setenv", k, v]
    return (*args, "--", python)


def _bwrap_command(python: str, limits: Limits, filter_fd: int, *program: str) -> list[str]:
    """bubblewrap's command line for one run: the seccomp filter at `filter_fd` (inherited)."""
    args = bwrap_args(python, limits)
    return [*args[:-2], "--seccomp", str(filter_fd), *args[-2:], *program]


@functools.lru_cache(maxsize=4)
def namespaces_problem(python: str | None = None) -> str | None:
    """Why the "namespaces" mode cannot run here (one line), or None when it can. Probed once."""
    python = python or interpreter()
    if shutil.which("bwrap") is None:
        return ("bubblewrap is not installed (`bwrap` not on PATH): install Debian's `bubblewrap` package "
                "(scripts/setup.sh does as root)")
    try:
        seccomp.seccomp_filter()
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        return (f"its seccomp filter cannot be built ({type(e).__name__}: {e}): install libseccomp (Debian's "
                "`libseccomp2`) and the Python package pyseccomp")
    fd = seccomp.filter_fd()
    try:
        p = subprocess.run(_bwrap_command(python, Limits(), fd, "-I", "-S", "-c", "print('ok')"),
                           capture_output=True, timeout=30, stdin=subprocess.DEVNULL, pass_fds=(fd,))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap did not start: {e}"
    finally:
        os.close(fd)
    if p.returncode != 0 or p.stdout.strip() != b"ok":
        why = p.stderr.decode("utf-8", "replace").strip().splitlines()
        return (f"the kernel refused bubblewrap's namespaces ({why[-1] if why else f'exit {p.returncode}'}; "
                "user namespaces may be off in this container: sysctl kernel.unprivileged_userns_clone, "
                "user.max_user_namespaces)")
    return None


@dataclass(frozen=True)
class Sandbox:
    """Where untrusted code runs (``isolation``, and ``url`` for "remote") and what it may use."""

    isolation: str = "namespaces"
    limits: Limits = field(default_factory=Limits)
    url: str | None = None

    def check(self, key: str = "isolation", url_key: str = "sandbox_url") -> None:
        """Refuse to run untrusted code without the walls the recipe asked for: one line."""
        if self.isolation not in ISOLATIONS:
            raise RewardError(f"{key}: expected one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.isolation == "namespaces":
            problem = namespaces_problem()
            if problem is not None:
                raise RewardError(f"{key}: cannot sandbox untrusted code here: {problem}; or accept the weaker "
                                  f"in-process walls with `{key}: process`, or name an execution service with "
                                  f"`{key}: remote` (see docs/rewards.md, the sandbox)")
        if self.isolation == "remote":
            if not (self.url or "").startswith(("http://", "https://")):
                raise RewardError(f"{url_key}: `{key}: remote` needs the service's http(s) URL, got {self.url!r}")
            try:
                out = self.run("print('ok')", b"")
            except RewardError as e:
                raise RewardError(f"{url_key}: {e}") from None
            if out.stdout.strip() != b"ok":
                raise RewardError(f"{url_key}: {self.url} ran `print('ok')` and sent back "
                                  f"{out.stdout[:80]!r} ({out.stderr or 'no message'}); is it a SandboxFusion "
                                  "`/run_code` service?")

        if self.isolation == "process":
            undumpable()  # the driver: it holds the rows' tests before any sample runs

    def config(self, **cfg: object) -> dict:
        """What a program of `rlkit.reward.runners` applies to itself before anything else (its
        stdin's first line): its limits; as root, the throwaway uid it drops to; in "process" mode
        the seccomp filter it loads and, for a uid that may not read the interpreter's folders,
        its import path through folders it opens first (``reroot``)."""
        uid = next_uid() if self.isolation != "remote" and running_as_root() else None
        process = self.isolation == "process"
        return {"limits": self.limits.rlimits(), "uid": uid, "reroot": process and uid is not None,
                "filter": seccomp.seccomp_filter(process=True).hex() if process else None, **cfg}

    def run(self, program: str, payload: bytes, uid: int | None = None) -> Outcome:
        """Run ``program`` (Python source) in the sandbox with ``payload`` on stdin; see the module doc.

        The program itself applies the limits it is given in its payload (`config`), ``uid`` among
        them; here the wall clock and the output bound are enforced and everything is killed afterwards.
        """
        if self.isolation == "remote":
            return self._post(program, payload)
        t0 = time.perf_counter()
        run = self.spawn(program, uid)
        pipes = Exchange(run.proc, payload, self.limits.output_kb << 10)
        try:
            out, timed_out, flooded = pipes.until(t0 + self.limits.timeout_s)
        finally:
            reap(run)
        said = b"".join(pipes.err)[:2048].decode("utf-8", "replace").strip().replace("\n", " | ")
        return Outcome(out, timed_out, flooded, time.perf_counter() - t0, said)

    def spawn(self, program: str, uid: int | None = None) -> Started:
        """Start ``program`` in a local sandbox, its pipes open, before it is given its payload: the
        process, its throwaway working directory ("process" mode, owned by ``uid``, the one it drops
        to), and where the host delegates one, the memory cgroup that holds it (`rlkit.reward.cgroup`:
        its processes and its scratch folders, ``memory_mb`` + ``scratch_mb`` together); for `reap`."""
        python, work, fds = interpreter(), None, ()
        if self.isolation == "namespaces":
            fds = (seccomp.filter_fd(),)
            cmd = _bwrap_command(python, self.limits, fds[0], "-I", "-S", "-c", program)
            cwd, env = "/", {"PATH": _ENV["PATH"]}  # bubblewrap's own: it clears it for the program
        else:
            undumpable()  # this process holds the tests and the pipes the verdicts come back on
            work = tempfile.mkdtemp(prefix="rlkit-sandbox-")
            os.chmod(work, 0o700)
            if uid is not None:
                os.chown(work, uid, uid)
            cmd = [python, "-I", "-S", "-c", program]
            cwd, env = work, {**_ENV, "HOME": work}
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=fds)
        except BaseException:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
            uids.release(uid)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        cap = None
        if cgroup.delegated() is not None:
            try:
                cap = cgroup.Cap((self.limits.memory_mb + self.limits.scratch_mb) << 20)
                cap.add(proc.pid)
            except OSError:
                reap(Started(proc, work, uid, cap))
                raise RewardError(f"the code sandbox's memory cgroup could not be made under "
                                  f"{cgroup.delegated()[0]}") from None
        return Started(proc, work, uid, cap)

    def _post(self, program: str, payload: bytes) -> Outcome:
        """One SandboxFusion ``/run_code`` request; its reply read up to the output bound."""
        limit = self.limits.output_kb << 10
        body = json.dumps({"code": program, "language": "python", "stdin": payload.decode("utf-8"),
                           "run_timeout": self.limits.timeout_s, "compile_timeout": 10,
                           "memory_limit_MB": self.limits.memory_mb}).encode()
        url = str(self.url).rstrip("/")
        url = url if url.endswith("/run_code") else url + "/run_code"
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.limits.timeout_s + 30) as resp:
                raw = resp.read(4 * limit + 65536)
        except (urllib.error.URLError, OSError) as e:
            raise RewardError(f"the remote sandbox {url} did not answer: {getattr(e, 'reason', e)}") from None
        try:
            reply = json.loads(raw)
            result = reply.get("run_result") or {}
            stdout = str(result.get("stdout") or "").encode("utf-8")
        except (ValueError, AttributeError):
            raise RewardError(f"the remote sandbox {url} sent back no SandboxFusion reply: {raw[:120]!r}") from None
        return Outcome(stdout[:limit], result.get("status") == "TimeLimitExceeded", len(stdout) > limit,
                       time.perf_counter() - t0, str(result.get("stderr") or reply.get("message") or "")[:2048])
