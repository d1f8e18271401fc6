"""Run model-written Python against test cases in a sandbox; reward = fraction passed.

Test cases (the ``test_cases`` column, or open-r1's ``verification_info`` (same shape), one
list per sample, or its JSON string; an open-r1 entry whose ``language`` is not Python scores
None, not applicable):
* a string: a statement run after the solution, e.g. ``"assert add(2, 3) == 5"``;
* ``{"input": str, "output": str}``: the solution runs as ``__main__`` with that stdin and
  its stdout must equal ``output`` (trailing whitespace per line ignored).

Containment, in layers (each is tested in ``tests/rewards/test_reward_code.py``):
* a separate process per sample in its own session: ``python -I`` (no user site, no
  ``PYTHON*`` env), a minimal environment (``PATH``, ``HOME``=workdir; no inherited
  secrets), a throwaway working directory, stdin closed after the payload;
* wall-clock limit (the whole session is killed), RLIMIT_CPU, RLIMIT_AS (memory),
  RLIMIT_FSIZE (file size), RLIMIT_NOFILE, no core dumps;
* as root: a fresh network namespace (``unshare(CLONE_NEWNET)``: no interface but a down
  loopback, so nothing is reachable), a fresh PID namespace (the runner is its pid 1; when
  it exits the kernel kills and reaps all its descendants, so no zombies), and a throwaway uid
  (with RLIMIT_NPROC, which the
  kernel does not enforce for uid 0: fork bombs stop at ``max_procs``). That uid owns only
  the workdir, so writing elsewhere fails with EACCES, except world-writable dirs, which
  are swept of its files afterwards. It keeps CAP_DAC_READ_SEARCH (read-only) so it can
  load the interpreter from root-only paths such as ``/root/.pyenv``;
* not root: RLIMIT_NPROC=1 (no child processes at all);
* in the child, a Python audit hook refusing sockets, subprocesses, fork/exec, signals,
  ctypes, and writes/deletes outside the working directory;
* afterwards every process of that uid and the session is SIGKILLed.
Not a defence against a solution that tampers with the test harness inside its own
process (e.g. forging result lines); it protects the host, not the reward's integrity.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlkit.reward.contract import completion_text, needs_one_of

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_UID_BASE = 1_000_000_000
_uid_lock = threading.Lock()
_uid_counter = 0
_SWEEP = ("/tmp", "/var/tmp", "/dev/shm")

# Runs as root in a fresh process (no threads, so no preexec_fn hazards), drops into the
# sandbox and execs the runner. argv[1]: JSON config.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
c = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
for name, v in c["limits"].items():
    resource.setrlimit(getattr(resource, name), (v, v))
if c["root"]:
    # CLONE_NEWNET (no reachable network) | CLONE_NEWPID: the runner becomes pid 1 of its own
    # namespace, so when it ends the kernel kills and reaps everything it spawned.
    if libc.unshare(0x40000000 | 0x20000000) != 0:
        libc.unshare(0x40000000)  # best effort; the audit hook also blocks sockets
    else:
        pid = os.fork()
        if pid:
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    uid = c["uid"]
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
    class H(ctypes.Structure): _fields_ = [("v", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class D(ctypes.Structure): _fields_ = [("e", ctypes.c_uint32), ("p", ctypes.c_uint32), ("i", ctypes.c_uint32)]
    d = (D * 2)(); d[0].e = d[0].p = d[0].i = 1 << 2  # CAP_DAC_READ_SEARCH only
    if libc.capset(ctypes.byref(H(0x20080522, 0)), d) == 0:
        libc.prctl(47, 2, 2, 0, 0)  # PR_CAP_AMBIENT_RAISE CAP_DAC_READ_SEARCH (survives exec)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.execve(sys.executable, [sys.executable, "-I", "-c", c["runner"]], c["env"])
"""

# Runs in the sandbox. stdin line 1: JSON {code, tests, nonce, audit}. Writes
# "<nonce> <i> <0|1>" per test to the original stdout.
_RUNNER = r"""
import io, json, os, sys
cfg = json.loads(sys.stdin.readline())
sys.stdin = io.StringIO("")
res = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 0)
nonce, code, tests = cfg.pop("nonce"), cfg["code"], cfg["tests"]
cwd = os.path.realpath(os.getcwd()) + os.sep
def inside(p):
    try:
        return os.path.realpath(os.fsdecode(p)).startswith(cwd)
    except Exception:
        return False
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
BLOCK = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
         "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
         "os.chown", "os.setuid", "sys.addaudithook", "pty.spawn", "os.startfile"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.link", "os.symlink",
         "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
def hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        if isinstance(path, int):
            return
        w = (isinstance(mode, str) and any(m in mode for m in "wax+")) or (isinstance(flags, int) and flags & WRITE)
        if w and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory")
    elif event in BLOCK:
        raise PermissionError("sandbox: " + event + " is not allowed")
    elif event in PATHS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not inside(args[0]):
        raise PermissionError("sandbox: " + event + " outside the working directory")
if cfg["audit"]:
    sys.addaudithook(hook)
def report(i, ok):
    res.write(f"{nonce} {i} {int(ok)}\n"); res.flush()
def norm(s):
    return "\n".join(l.rstrip() for l in s.strip().splitlines())
try:
    compiled = compile(code, "solution.py", "exec")
except BaseException:
    compiled = None
if all(isinstance(t, str) for t in tests):
    g = {"__name__": "solution"}
    try:
        exec(compiled, g)
        ok = compiled is not None
    except BaseException:
        ok = False
    for i, t in enumerate(tests):
        try:
            if not ok:
                raise RuntimeError
            sys.stdout = io.StringIO(); exec(t, g); report(i, True)
        except BaseException:
            report(i, False)
else:
    for i, t in enumerate(tests):
        sys.stdin, sys.stdout = io.StringIO(str(t.get("input", ""))), io.StringIO()
        try:
            if compiled is None:
                raise RuntimeError
            try:
                exec(compiled, {"__name__": "__main__"})
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            report(i, norm(sys.stdout.getvalue()) == norm(str(t.get("output", ""))))
        except BaseException:
            report(i, False)
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sample: tests passed / total, whether the wall clock ran out."""

    passed: int
    total: int
    timed_out: bool
    seconds: float

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: Any) -> str:
    """The last fenced code block (```python, ```py or bare ```); "" when there is none."""
    blocks = _FENCE.findall(completion_text(completion))
    return blocks[-1] if blocks else ""


def _next_uid() -> int:
    global _uid_counter
    with _uid_lock:
        _uid_counter += 1
        return _UID_BASE + (os.getpid() % 100_000) * 1000 + _uid_counter % 1000


def _kill_uid(uid: int, rounds: int = 20) -> None:
    """SIGKILL every process owned by ``uid`` until none is left (fork bombs respawn)."""
    for _ in range(rounds):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    real = next((line.split()[1] for line in f if line.startswith("Uid:")), None)
                if real == str(uid):
                    found = True
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        if not found:
            return
        time.sleep(0.01)


def _sweep(uid: int) -> None:
    """Remove what ``uid`` left in the world-writable directories."""
    for d in _SWEEP:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                pass


def run_tests(code: str, tests: list, *, timeout_s: float = 5.0, memory_mb: int = 512,
              max_procs: int = 4, file_mb: int = 16, audit: bool = True) -> SandboxResult:
    """Run ``code`` against ``tests`` in the sandbox described in the module docstring.

    timeout_s: wall clock for the whole sample (CPU limit = ceil(timeout_s) + 1 s).
    memory_mb: address-space limit. max_procs: processes+threads of the sandbox uid (root
    only). file_mb: largest file it may write. audit: install the audit hook (tests turn
    it off to prove the OS-level layers hold on their own).
    """
    if not tests:
        return SandboxResult(0, 0, False, 0.0)
    root = os.geteuid() == 0
    uid = _next_uid() if root else os.getuid()
    work = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    if root:
        os.chown(work, uid, uid)
    os.chmod(work, 0o700)
    limits = {"RLIMIT_CPU": math.ceil(timeout_s) + 1, "RLIMIT_AS": memory_mb << 20,
              "RLIMIT_FSIZE": file_mb << 20, "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0,
              "RLIMIT_NPROC": max_procs if root else 1}
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    cfg = {"limits": limits, "root": root, "uid": uid, "env": env, "runner": _RUNNER}
    nonce = secrets.token_hex(8)
    payload = json.dumps({"code": code, "tests": tests, "nonce": nonce, "audit": audit}) + "\n"
    t0 = time.perf_counter()
    timed_out = False
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)], cwd=work, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(payload.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        # Kill the sandbox uid first so the root launcher reaps its child (killing both at
        # once would orphan the child to an init that may never reap it), then the session.
        if root:
            _kill_uid(uid)
        try:
            out, _ = proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            out, _ = proc.communicate()
    finally:
        if root:
            _kill_uid(uid)
            _sweep(uid)
        _killpg(proc.pid)
        shutil.rmtree(work, ignore_errors=True)
    passed = set()
    for line in out.decode("utf-8", "replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "1":
            passed.add(int(parts[1]))
    return SandboxResult(len(passed), len(tests), timed_out, time.perf_counter() - t0)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _tests_of(t: Any) -> list | None:
    if t is None:
        return None
    if isinstance(t, str):
        t = json.loads(t)
    if isinstance(t, dict):  # open-r1 verification_info / {"inputs": [...], "outputs": [...]}
        if str(t.get("language", "python")).lower() not in ("python", "python3", "py"):
            return None  # only Python runs here: not applicable
        if "test_cases" in t:
            return _tests_of(t["test_cases"])
        if "inputs" in t:
            return [{"input": i, "output": o} for i, o in zip(t["inputs"], t["outputs"])]
        t = [t]
    return list(t) or None


@needs_one_of("test_cases", "verification_info")
def code_reward(completions: list, test_cases: list | None = None, verification_info: list | None = None,
                timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 4, workers: int | None = None,
                **kwargs: Any) -> list[float | None]:
    """Fraction of the test cases (``test_cases``, else ``verification_info``) the last fenced
    code block of each completion passes.

    0.0 without a code block; None for samples without test cases. Samples run in
    parallel (``workers``, default: CPU count), each in its own sandbox (see module doc).
    """
    column = test_cases if test_cases is not None else verification_info
    if column is None:
        raise ValueError("code_reward needs a 'test_cases' or 'verification_info' column")
    tests = [_tests_of(t) for t in column]
    codes = [extract_code(c) for c in completions]

    def one(i: int) -> float | None:
        if tests[i] is None:
            return None
        if not codes[i].strip():
            return 0.0
        return run_tests(codes[i], tests[i], timeout_s=timeout_s, memory_mb=memory_mb,
                         max_procs=max_procs).score

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(one, range(len(completions))))
