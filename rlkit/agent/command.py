"""An agent program that is a command (`rollout.program.command`): any executable (an agent CLI,
a script in another language, a Python file with its own dependencies) run once per rollout.

It finds its session as the OpenAI SDKs do, in ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; the
prompt row is ``RLKIT_ROW`` (JSON) and its stdin. Its working directory is the recipe's folder
(read-only). Its last line of stdout, when it is a number or ``{"reward": r}``, is its reward.
A non-zero exit, or a run past `rollout.program.timeout_s` (the whole process tree is killed),
fails its rollout as a crashing function does.

Isolation (`rollout.program.isolation`):
* ``namespaces`` (the default): the sandbox's walls (`rlkit.sandbox.walls`: bubblewrap's
  namespaces, the seccomp filter, a throwaway uid as root, resource limits, a memory cgroup of
  ``memory_mb`` + 256 MiB of scratch where the host delegates one), with the Python
  environment rlkit runs in and the recipe's folder mounted read-only, ``/tmp`` (also its HOME)
  writable, and a network of its own whose only way out is the endpoint: the endpoint also
  listens on a Unix socket, mounted into the sandbox, and a relay inside forwards
  ``127.0.0.1:PORT`` there. Nothing else of the host (files, processes, other ports) is reachable.
* ``process``: a child process in its own session with the driver's network and files, for a
  program that must reach other services (an agent's web tools): no walls (where the host
  delegates a cgroup, one without a bound gathers what it starts, so that all of it ends with it).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from rlkit.errors import ConfigError
from rlkit.program_config import ProgramConfig
from rlkit.sandbox.pipes import Started, reap
from rlkit.sandbox.walls import Limits, Walls, interpreter, next_uid, running_as_root, start

SOCKET_DIR = "/run/rlkit"  # where the endpoint's Unix socket is inside the sandbox

# Runs inside the sandbox (python -I -S): bind the endpoint's port on the sandbox's own loopback,
# fork the relay (each connection piped to the endpoint's Unix socket), apply the limits, drop to
# the throwaway uid, exec the command. The port is bound before the command starts: its first
# connection waits in the backlog.
LAUNCHER = r"""
import json, os, resource, socket, sys, threading
cfg = json.loads(sys.argv[1])
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", cfg["port"]))
listener.listen(128)
def settle():
    for name, v in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (v, v))
    if cfg["uid"] is not None:
        u = cfg["uid"]
        os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((b, socket.SHUT_WR), (a, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass
if os.fork() == 0:
    settle()
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(cfg["socket"])
        except OSError:
            conn.close(); up.close(); continue
        threading.Thread(target=pump, args=(conn, up), daemon=True).start()
        threading.Thread(target=pump, args=(up, conn), daemon=True).start()
listener.close()
settle()
os.execvp(cfg["argv"][0], cfg["argv"])
"""


class CommandProgram:
    """`run(row, client)` for a command: the client's session URL and key go to the command."""

    def __init__(self, cfg: ProgramConfig, recipe_dir: str | None, socket_path: str | None, port: int):
        self.cfg, self.cwd = cfg, os.path.realpath(recipe_dir or os.getcwd())
        self.argv = shlex.split(cfg.command) if isinstance(cfg.command, str) else list(cfg.command or ())
        self.socket_path, self.port = socket_path, port

    def check(self) -> None:
        """Before launch: the command can be found, and the sandbox can run here (one line)."""
        import shutil

        if not self.argv:
            raise ConfigError("is empty: name the program to run", "rollout.program.command")
        exe = self.argv[0]
        found = shutil.which(exe, path=self._path()) if os.sep not in exe else \
            os.path.join(self.cwd, exe) if os.access(os.path.join(self.cwd, exe), os.X_OK) else None
        if found is None:
            raise ConfigError(f"{exe!r} is not an executable on the program's PATH ({self._path()}) or in "
                              f"{self.cwd}", "rollout.program.command")
        if self.cfg.isolation == "namespaces":
            from rlkit.sandbox.walls import namespaces_problem

            problem = namespaces_problem()
            if problem is not None:
                raise ConfigError(f"cannot wall the program off here: {problem}; or run it without walls with "
                                  "rollout.program.isolation: process", "rollout.program.isolation")

    def _path(self) -> str:
        return f"{os.path.join(sys.prefix, 'bin')}:/usr/local/bin:/usr/bin:/bin"

    def __call__(self, row: Mapping[str, Any], client: Any) -> Any:
        row_json = json.dumps(dict(row), default=str)
        env = {"OPENAI_BASE_URL": str(client.base_url).rstrip("/"), "OPENAI_API_KEY": client.api_key,
               "RLKIT_ROW": row_json, "PATH": self._path(), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        if self.cfg.isolation == "namespaces":
            run = self._walled(env)
        else:  # no walls: a cgroup without a bound, so that all it started ends with it
            env = {**env, "HOME": os.environ.get("HOME", "/tmp")}
            run = start(self.argv, Walls(self._limits(), "process", cwd=self.cwd, env=tuple(env.items()),
                                         bounded=False))
        try:
            out, err = run.proc.communicate(row_json.encode(), timeout=self.cfg.timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running after {self.cfg.timeout_s:g} s") from None
        finally:
            reap(run)  # everything it started, its uid given back
        if run.proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()
            raise RuntimeError(f"exit status {run.proc.returncode}" + (f": {tail[-1][:160]}" if tail else ""))
        return _reward(out)

    def _limits(self) -> Limits:
        return Limits(timeout_s=self.cfg.timeout_s, memory_mb=self.cfg.memory_mb, max_procs=self.cfg.max_procs,
                      scratch_mb=256)

    def _walled(self, env: dict[str, str]) -> Started:
        """The command in the sandbox's walls (`rlkit.sandbox.walls`), with the Python environment, the
        recipe's folder and the endpoint's socket folder mounted read-only, its environment, the
        launcher first; as root it drops to a throwaway uid (claimed here, given back by `reap`)."""
        limits = self._limits()
        binds = [(path, path) for path in sorted({os.path.realpath(sys.prefix), self.cwd})]
        binds.append((os.path.dirname(self.socket_path), SOCKET_DIR))
        rlimits = limits.rlimits()
        rlimits.pop("RLIMIT_CPU")  # the wall clock bounds it; threads of a waiting client use little
        if not running_as_root():
            rlimits.pop("RLIMIT_NPROC")  # counted per real user outside: the user's other processes too
        uid = next_uid() if running_as_root() else None
        launcher = {"port": self.port, "socket": f"{SOCKET_DIR}/{os.path.basename(self.socket_path)}",
                    "limits": rlimits, "uid": uid, "argv": self.argv}
        walls = Walls(limits, binds=tuple(binds), cwd=self.cwd,
                      env=tuple({**env, "HOME": "/tmp", "TMPDIR": "/tmp"}.items()))
        return start([interpreter(), "-I", "-S", "-c", LAUNCHER, json.dumps(launcher)], walls, uid=uid)


def _reward(stdout: bytes) -> Any:
    """The command's reward: its last line of stdout, when that is a number or {"reward": r}."""
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    if not lines:
        return None
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return None
    return value if isinstance(value, (int, float, dict)) and not isinstance(value, bool) else None

