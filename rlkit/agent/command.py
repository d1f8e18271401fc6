"""An agent program that is a command (`rollout.program.command`): any executable (an agent CLI,
a script in another language, a Python file with its own dependencies) run once per rollout.

It finds its session as the OpenAI SDKs do, in ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; the
prompt row is ``RLKIT_ROW`` (JSON) and its stdin. Its working directory is the recipe's folder
(read-only). Its last line of stdout, when it is a number or ``{"reward": r}``, is its reward.
A non-zero exit, or a run past `rollout.program.timeout_s` (the whole process tree is killed),
fails its rollout as a crashing function does.

Isolation (`rollout.program.isolation`):
* ``namespaces`` (the default): the code sandbox's walls (rlkit/reward/sandbox.py: bubblewrap's
  namespaces, the seccomp filter, a throwaway uid as root, resource limits), with the Python
  environment rlkit runs in and the recipe's folder mounted read-only, ``/tmp`` (also its HOME)
  writable, and a network of its own whose only way out is the endpoint: the endpoint also
  listens on a Unix socket, mounted into the sandbox, and a relay inside forwards
  ``127.0.0.1:PORT`` there. Nothing else of the host (files, processes, other ports) is reachable.
* ``process``: a child process in its own session with the driver's network and files, for a
  program that must reach other services (an agent's web tools): no walls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from rlkit.errors import ConfigError
from rlkit.program_config import ProgramConfig
from rlkit.reward import uids

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
            from rlkit.reward.sandbox import namespaces_problem

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
            cmd, fds, uid = self._sandboxed(env)
            env = {"PATH": "/usr/bin:/bin"}  # bubblewrap's own: it sets the program's
        else:
            cmd, fds, uid = self.argv, (), None
            env = {**env, "HOME": os.environ.get("HOME", "/tmp")}
        try:
            proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=fds)
        except BaseException:
            uids.release(uid)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        try:
            out, err = proc.communicate(row_json.encode(), timeout=self.cfg.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise TimeoutError(f"still running after {self.cfg.timeout_s:g} s") from None
        finally:
            _kill_tree(proc)
            uids.release(uid)  # its processes ended with bubblewrap's PID namespace
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()
            raise RuntimeError(f"exit status {proc.returncode}" + (f": {tail[-1][:160]}" if tail else ""))
        return _reward(out)

    def _sandboxed(self, env: dict[str, str]) -> tuple[list[str], tuple[int, ...], int | None]:
        """bubblewrap's command line: the code sandbox's, with the Python environment, the recipe's
        folder and the endpoint's socket folder mounted, the environment set, the launcher first; the
        descriptors it is passed, and as root the throwaway uid it drops to (claimed: `uids.release`)."""
        from rlkit.reward import seccomp
        from rlkit.reward.sandbox import Limits, bwrap_args, interpreter, next_uid, running_as_root

        python = interpreter()
        limits = Limits(timeout_s=self.cfg.timeout_s, memory_mb=self.cfg.memory_mb, max_procs=self.cfg.max_procs,
                        scratch_mb=256)
        args = list(bwrap_args(python, limits)[:-2])
        at = args.index("--chdir")
        del args[at:at + 2]  # the recipe's folder instead
        mounts = []  # before the root is remounted read-only: their mount points are made in it
        for path in sorted({os.path.realpath(sys.prefix), self.cwd}):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):  # the folders above it: traversable by the throwaway uid
                mounts += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
            mounts += ["--ro-bind", path, path]
        mounts += ["--perms", "0755", "--dir", os.path.dirname(SOCKET_DIR),
                   "--ro-bind", os.path.dirname(self.socket_path), SOCKET_DIR, "--chdir", self.cwd]
        at = args.index("--remount-ro")
        args[at:at] = mounts
        for k, v in {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            args += ["--setenv", k, v]
        rlimits = limits.rlimits()
        rlimits.pop("RLIMIT_CPU")  # the wall clock bounds it; threads of a waiting client use little
        if not running_as_root():
            rlimits.pop("RLIMIT_NPROC")  # counted per real user outside: the user's other processes too
        uid = next_uid() if running_as_root() else None
        launcher = {"port": self.port, "socket": f"{SOCKET_DIR}/{os.path.basename(self.socket_path)}",
                    "limits": rlimits, "uid": uid, "argv": self.argv}
        fd = seccomp.filter_fd()
        return ([*args, "--seccomp", str(fd), "--", python, "-I", "-S", "-c", LAUNCHER, json.dumps(launcher)], (fd,),
                uid)


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


def _kill_tree(proc: subprocess.Popen) -> None:
    """The command and everything it started (its session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
