"""Nothing of a run outlives its driver, however the driver dies.

When rlkit starts a local Ray instance, the driver first marks its environment with a token of
its own (`RLKIT_RUN_TOKEN`), which Ray's services, its workers and the processes they start
(vLLM's) inherit, and starts a small watcher process in a session of its own. The watcher notes
the driver's descendants started since, every second (Ray's dashboard and runtime-env agents
do not inherit the driver's environment, and outlive a killed driver by a minute or more), and
waits on a pipe from the driver. The pipe closes when the driver is done with Ray (`stop()`,
after `ray.shutdown()`): the watcher ends what still carries the token; or when the driver dies
by any signal, SIGKILL included (an out-of-memory killer, a scheduler's hard stop): the watcher
ends that and every descendant it noted (SIGTERM, then SIGKILL after a grace period). A run that
joins a cluster (`ray.address`) starts no watcher: the cluster's processes are not the run's.

On every node, each learner and engine actor also watches the way back (`exit_when_cut_off`): a
host cut off from the network keeps its Ray node, and the node its actors (blocked in a
collective, or idle), long after the driver has given up on them. An actor that cannot reach the
cluster's head for as long as Ray waits for it (60 s), or for its collective timeout if that is
shorter, ends itself and what it started.

Files the run's processes write to a host's disk for their own use (the engines' LoRA adapter
versions) go under the run's folder (`run_folder`), which the watcher removes after the run, however
it ended, and an engine started again removes its predecessor's part of at its start.

    python -m rlkit.actors.reaper TOKEN DRIVER_PID   (started by `watch`, not by hand)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

TOKEN_ENV = "RLKIT_RUN_TOKEN"
GRACE_S = 3.0  # SIGTERM, then SIGKILL for what is still there after this
STOP = b"stop\n"


def watch() -> Callable[[], None]:
    """Mark this process's environment with a fresh token and start the watcher; returns `stop`,
    which ends what still carries the token, waits for the watcher and removes the mark."""
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "rlkit.actors.reaper", token, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, close_fds=True)
    os.environ[TOKEN_ENV] = token

    def stop() -> None:
        if os.environ.get(TOKEN_ENV) == token:
            del os.environ[TOKEN_ENV]
        try:
            proc.stdin.write(STOP)  # the driver is done with Ray (a pipe closed without it: the driver died)
            proc.stdin.close()
            proc.wait(timeout=GRACE_S + 10)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return stop


def run_folder(part: str | None = None, token: str | None = None, empty: bool = False) -> Path | None:
    """The watched run's folder on this host (its `part`, made when missing; `empty`: emptied of what a
    process of the same part left, killed) for files its processes keep on disk: removed by the watcher
    when the run ends, however it ends. None outside a watched run (a run that joined a cluster: its
    processes keep their files where they did)."""
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        return None
    folder = Path(tempfile.gettempdir()) / f"rlkit-run-{token}"
    if part:
        folder /= part
    if empty:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def carrying(token: str, name: str = TOKEN_ENV) -> list[int]:
    """Pids of the processes whose environment holds ``name=token`` (this one excluded)."""
    mark = f"{name}={token}".encode()
    me = os.getpid()
    if not os.path.isdir("/proc"):
        return _carrying_psutil(token, name)
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return out


def _carrying_psutil(token: str, name: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(name) == token:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def descendants(pid: int, since: float) -> dict[int, float]:
    """The processes below `pid` started at or after `since` (epoch seconds): {pid: start time}."""
    import psutil

    out = {}
    try:
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.pid != os.getpid() and p.create_time() >= since:
                    out[p.pid] = p.create_time()
    except psutil.Error:  # the driver is gone
        pass
    return out


def _alive(noted: dict[int, float]) -> list[int]:
    """The noted processes still running (the same process: its start time matches)."""
    import psutil

    out = []
    for pid, started in noted.items():
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).create_time() == started:
                out.append(pid)
    return out


def end(token: str, noted: dict[int, float] | None = None, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process carrying the token (and the `noted` ones still running), SIGKILL what
    is left after `grace_s`; how many there were."""
    def left() -> list[int]:
        return sorted(set(carrying(token)) | set(_alive(noted or {})))

    pids = left()
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    remaining = pids
    while remaining and time.monotonic() < deadline:
        time.sleep(0.1)
        remaining = left()
    for pid in remaining:
        _signal(pid, signal.SIGKILL)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.kill(pid, sig)


def head_window_s() -> float:
    """How long Ray's own processes keep trying to reach the cluster's head before they give up (its GCS
    reconnect window, `RAY_gcs_rpc_server_reconnect_timeout_s`, 60 s by default)."""
    try:
        return float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", 60))  # noqa: SIM112 (Ray's spelling)
    except ValueError:
        return 60.0


def exit_when_cut_off(limit_s: float | None, what: str, every_s: float = 2.0) -> threading.Thread | None:
    """In a Ray actor (`what`: "learner 1"): a daemon thread that connects to the cluster's head
    (Ray's GCS address) every `every_s` seconds and, once it has failed to for as long as Ray waits for
    its head (`head_window_s`) or for `limit_s` (the actor's collective timeout) if that is shorter (a
    slow collective is not a lost head: nothing else can tell the actor to stop), says so in the
    actor's log and ends the process and its children. None (no thread) outside a Ray actor, or
    without a limit."""
    import ray

    if not limit_s or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    window = head_window_s()
    why = "Ray's reconnect window" if window < limit_s else "its collective timeout"
    limit_s = min(limit_s, window)

    def reachable() -> bool:
        try:
            with socket.create_connection((host, int(port)), timeout=every_s):
                return True
        except OSError:
            return False

    def watch() -> None:
        since = None
        while True:
            if reachable():
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= limit_s:
                print(f"rlkit: {what}: the cluster's head at {host}:{port} has not been reachable for {limit_s:.0f} s "
                      f"({why}): this host is cut off, and the process ends", flush=True)
                end_children()
                os._exit(70)
            time.sleep(every_s)

    thread = threading.Thread(target=watch, name="rlkit-cut-off", daemon=True)
    thread.start()
    return thread


def end_children() -> None:
    """SIGKILL every process below this one (vLLM's engine core, compile workers)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            _signal(child.pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    import select

    token, driver, since = argv[0], int(argv[1]), time.time() - 1.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver: the watcher still cleans up
    noted: dict[int, float] = {}
    said = b""
    while True:  # until the driver closes the pipe or dies: a read returns b"" then
        noted.update(descendants(driver, since))
        try:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
            got = os.read(sys.stdin.fileno(), 4096) if ready else None
        except OSError:
            got = b""
        if got == b"":
            break
        said += got or b""
    end(token, None if STOP in said else noted)  # a driver that died: everything it started goes
    shutil.rmtree(Path(tempfile.gettempdir()) / f"rlkit-run-{token}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
