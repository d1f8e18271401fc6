"""Run untrusted code walled off by the kernel; what comes back is data for a judge outside.

`Sandbox(isolation, limits, url).run(program, payload)` starts ``python -I -S -c program`` with
``payload`` on its stdin and returns what it wrote on stdout (bounded), whether it timed out or
flooded, and how long it took. Nothing else of the caller reaches the program.

Isolation (``isolation``):
* ``"namespaces"`` (the default): the walls of `rlkit.sandbox.walls` (bubblewrap's namespaces, the
  seccomp filter, a throwaway uid as root, a memory cgroup where one is delegated), with nothing
  mounted beyond what every walled command sees, its scratch ``/tmp`` as its working directory and
  no environment but ``PATH``/``HOME``/``LANG``. The driver's files, environment, sockets (TCP, Unix
  and abstract) and processes do not exist there; everything it writes lives in memory that the
  kernel frees with the namespaces when the run ends (SysV IPC with its IPC namespace).
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

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from rlkit.errors import RewardError
from rlkit.sandbox import seccomp
from rlkit.sandbox.pipes import Exchange, Started, reap
from rlkit.sandbox.walls import (
    ENV,
    Limits,
    Walls,
    interpreter,
    namespaces_problem,
    next_uid,
    running_as_root,
    start,
    undumpable,
)

ISOLATIONS = ("namespaces", "remote", "process")


@dataclass(frozen=True)
class Outcome:
    """What came back from one run: stdout (at most ``output_kb``), and how it ended."""

    stdout: bytes
    timed_out: bool
    flooded: bool
    seconds: float
    stderr: str = ""  # what the sandbox itself said before the program took over (its first 2 KB)


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
        """What a program of `rlkit.sandbox.runners` applies to itself before anything else (its
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
        to), and where the host delegates one, the memory cgroup that holds it (`rlkit.sandbox.cgroup`:
        its processes and its scratch folders, ``memory_mb`` + ``scratch_mb`` together); for `reap`."""
        argv = [interpreter(), "-I", "-S", "-c", program]
        if self.isolation == "namespaces":
            return start(argv, Walls(self.limits), uid=uid)
        undumpable()  # this process holds the tests and the pipes the verdicts come back on
        work = tempfile.mkdtemp(prefix="rlkit-sandbox-")
        os.chmod(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        return start(argv, Walls(self.limits, "process", cwd=work, env=(*ENV.items(), ("HOME", work))), uid=uid,
                     work=work)

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
