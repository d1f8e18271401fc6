"""A walled command (`rlkit.sandbox.walls`), as the code judge and an agent's commands start it: it
sees the folders it is given read-only, works where it is told with only the environment it is given,
runs in a memory cgroup of its own where one is delegated, and `reap` leaves nothing of it."""

from __future__ import annotations

import json
import os
import time

import pytest

from rlkit.sandbox import cgroup
from rlkit.sandbox.pipes import Exchange, reap
from rlkit.sandbox.walls import Limits, Walls, interpreter, namespaces_problem, start

needs_namespaces = pytest.mark.skipif(namespaces_problem() is not None, reason=f"{namespaces_problem()}")

LOOK = r"""
import json, os
seen = {"cwd": os.getcwd(), "env": dict(os.environ), "read": open("/data/in/note.txt").read(),
        "root": sorted(os.listdir("/"))}
try:
    open("/data/in/new.txt", "w")
    seen["wrote"] = True
except OSError:
    seen["wrote"] = False
print(json.dumps(seen))
"""


@needs_namespaces
def test_a_walled_command_sees_its_binds_read_only_in_its_folder_with_its_environment(tmp_path):
    folder = tmp_path / "given"
    folder.mkdir()
    (folder / "note.txt").write_text("hello")
    for p in (tmp_path, folder):
        p.chmod(0o755)
    walls = Walls(binds=((str(folder), "/data/in"),), cwd="/data/in", env=(("ONLY", "this"), ("PATH", "/usr/bin")))
    run = start([interpreter(), "-I", "-S", "-c", "import sys; sys.stdin.read()\n" + LOOK], walls)
    try:
        with open(f"/proc/{run.proc.pid}/cmdline", "rb") as f:  # bubblewrap's, which any user may read
            line = f.read()
        out, timed_out, _ = Exchange(run.proc, b"go", 1 << 20).until(time.perf_counter() + 30)
    finally:
        reap(run)
    assert b"ONLY" not in line and b"--ro-bind" in line  # its environment came through a descriptor
    seen = json.loads(out)
    assert not timed_out and seen["read"] == "hello" and seen["wrote"] is False and seen["cwd"] == "/data/in"
    env = {k: v for k, v in seen["env"].items() if k not in ("PWD", "LC_CTYPE")}  # bubblewrap's and Python's own
    assert env == {"ONLY": "this", "PATH": "/usr/bin"}
    assert "data" in seen["root"] and os.path.basename(str(tmp_path)) not in seen["root"]
    assert not (folder / "new.txt").exists()


@pytest.mark.skipif(cgroup.delegated() is None, reason="no memory cgroup is delegated here")
@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_its_processes_are_in_its_cgroup_and_reap_ends_them_all(tmp_path, isolation):
    """A daemon it starts in a session of its own is in its cgroup too, and ends with it."""
    if isolation == "namespaces" and namespaces_problem():
        pytest.skip(namespaces_problem())
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
              "print('started', flush=True)\ntime.sleep(60)\n")
    walls = Walls(Limits(memory_mb=256), isolation, cwd="/tmp" if isolation == "namespaces" else str(tmp_path))
    run = start([interpreter(), "-I", "-S", "-c", daemon], walls)
    try:
        assert run.proc.stdout.readline() == b"started\n"
        pids = run.cap.pids()
        assert run.proc.pid in pids and len(pids) >= 3 - (isolation == "process")  # bubblewrap, its init, ...
        with open(os.path.join(run.cap.folder, "memory.limit_in_bytes" if run.cap.version == 1
                               else "memory.max")) as f:
            assert int(f.read()) == (256 + 64) << 20
    finally:
        reap(run)
    deadline = time.monotonic() + 5  # SIGKILLed: each leaves as the kernel ends it, then its cgroup goes
    while (_living(pids) or os.path.exists(run.cap.folder)) and time.monotonic() < deadline:
        cgroup._sweep_stale()
        time.sleep(0.02)
    assert _living(pids) == [] and not os.path.exists(run.cap.folder)


def _living(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return "Z"
