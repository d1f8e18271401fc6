"""A walled command: what the code judge's programs and an agent's commands both run in.

`start(argv, Walls(...))` starts ``argv`` with its pipes open and returns a `Started` for
`rlkit.sandbox.pipes.reap`, which ends everything it started. What it sees and may use:

* ``isolation="namespaces"`` (the default): bubblewrap (``bwrap``, Debian's ``bubblewrap`` package)
  puts the command in new user (when not root), mount, PID, network, IPC, UTS and cgroup
  namespaces: an empty root with only ``/usr``, the interpreter's prefix and the loader cache
  mounted read-only, the ``binds`` a caller adds (read-only, the folders above each made
  traversable), a fresh ``/proc`` and ``/dev``, a size-limited scratch ``/tmp`` and ``/dev/shm``,
  only the ``env`` it is given, a loopback of its own and no other interface, its own session, no
  capabilities. As root, bubblewrap runs without a user namespace and keeps only the capabilities
  the command needs to drop to its throwaway uid (`next_uid`), which it does itself before anything
  else (the kernel enforces no process limit for root). The seccomp filter (`rlkit.sandbox.seccomp`)
  is loaded before the command runs; without root bubblewrap also forbids nested user namespaces.
  The root and ``/dev`` are read-only: ``/tmp`` and ``/dev/shm`` are all it can write.
* ``isolation="process"``: a child in its own session on the host, in ``cwd`` with ``env``; the
  walls are what the command applies to itself.

Either way, where the host delegates a memory cgroup (`rlkit.sandbox.cgroup`), the command and all it
starts run in one of their own: bounded together by ``memory_mb + scratch_mb`` (unless ``bounded`` is
off), and ended together by `reap`, a process that left the command's session included. The
command applies its resource limits (`Limits.rlimits`) itself: it is the first thing to run inside.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlkit.errors import RewardError
from rlkit.sandbox import cgroup, seccomp, uids
from rlkit.sandbox.pipes import Started, reap, sweep

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


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
class Walls:
    """Where one command runs and what it sees (see the module doc).

    binds: (host path, path inside) pairs mounted read-only ("namespaces"; after the scratch
    ``/tmp``, so a host folder under ``/tmp`` shows through it). cwd: its working folder (inside,
    or on the host in "process" mode). env: its whole environment. bounded: its memory cgroup holds
    ``memory_mb + scratch_mb``; off, the cgroup only gathers its processes for `reap`.
    """

    limits: Limits = field(default_factory=Limits)
    isolation: str = "namespaces"
    binds: tuple[tuple[str, str], ...] = ()
    cwd: str = "/tmp"
    env: tuple[tuple[str, str], ...] = (*ENV.items(), ("HOME", "/tmp"))
    bounded: bool = True


def interpreter() -> str:
    """The Python a sandbox runs: this process's base interpreter (a venv's ``bin/python`` is a
    link to it; the judge's programs run with ``-I -S``, the standard library only)."""
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
    (`rlkit.sandbox.uids`)."""
    return uids.claim(sweep)


@functools.lru_cache(maxsize=16)
def _fixed(python: str, scratch_mb: int) -> tuple[str, ...]:
    """bubblewrap's options every walled command shares (built once): the namespaces, the read-only
    system folders and the interpreter's prefix, ``/proc``, ``/dev`` and the scratch folders."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    size = str(scratch_mb << 20)
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
    if running_as_root():  # no user namespace: keep what the command needs to drop to its throwaway uid
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
        args += _bind(prefix, prefix)
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    return (*args, "--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
            "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm", "--symlink", "/tmp", "/var/tmp")


def _bind(source: str, inside: str) -> list[str]:
    """A read-only bind, the folders above its mount point made first (traversable by anyone inside)."""
    parts = inside.strip("/").split("/")
    above = [["--perms", "0755", "--dir", "/" + "/".join(parts[:i])] for i in range(1, len(parts))]
    return [*(a for made in above for a in made), "--ro-bind", source, inside]


def bwrap_command(argv: Sequence[str], walls: Walls, filter_fd: int, python: str | None = None,
                  env_fd: int | None = None) -> list[str]:
    """bubblewrap's command line for ``argv`` in ``walls``, the seccomp filter read from ``filter_fd``
    (inherited); the environment read from ``env_fd`` (`env_file`), or on the line where none is given.
    The binds come before the root is remounted read-only: their mount points are made in it."""
    args = list(_fixed(python or interpreter(), walls.limits.scratch_mb))
    for source, inside in walls.binds:
        args += _bind(source, inside)
    args += ["--chdir", walls.cwd, "--remount-ro", "/dev", "--remount-ro", "/"]  # bubblewrap's own tmpfs
    args += ["--args", str(env_fd)] if env_fd is not None else _setenv(walls)
    return [*args, "--seccomp", str(filter_fd), "--", *argv]


def _setenv(walls: Walls) -> list[str]:
    return [a for k, v in walls.env for a in ("--setenv", k, v)]


def env_file(walls: Walls) -> int:
    """A descriptor bubblewrap reads the command's environment from (``--args``: NUL-separated options),
    so that it is not on bubblewrap's command line, which every user of the host may read
    (`/proc/PID/cmdline`): an agent command's session key and row among them."""
    fd = os.memfd_create("rlkit-walls-env", 0)
    os.write(fd, b"".join(a.encode() + b"\0" for a in _setenv(walls)))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def start(argv: Sequence[str], walls: Walls, *, uid: int | None = None, work: str | None = None) -> Started:
    """Start ``argv`` in ``walls``, its pipes open, before it is given any input; for `reap`, which
    also removes ``work`` (a host folder made for it) and gives back ``uid`` (the throwaway uid it
    drops to, claimed by `next_uid`), here too when it does not start."""
    fds: tuple[int, ...] = ()
    try:
        if walls.isolation == "namespaces":
            fds = (seccomp.filter_fd(),)
            fds += (env_file(walls),)
            cmd, cwd, env = bwrap_command(argv, walls, fds[0], None, fds[1]), "/", {"PATH": ENV["PATH"]}  # its own
        else:
            cmd, cwd, env = list(argv), walls.cwd, dict(walls.env)
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
            cap = cgroup.Cap((walls.limits.memory_mb + walls.limits.scratch_mb) << 20 if walls.bounded else None)
            cap.add(proc.pid)
        except OSError:
            reap(Started(proc, work, uid, cap))
            raise RewardError(f"the sandbox's memory cgroup could not be made under {cgroup.delegated()[0]}") from None
    return Started(proc, work, uid, cap)


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
        p = subprocess.run(bwrap_command([python, "-I", "-S", "-c", "print('ok')"], Walls(), fd, python),
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
