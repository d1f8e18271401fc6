"""A multi-host Ray cluster on one machine: each host is a Linux network namespace with its own
address, the hosts joined by a bridge that lives in a namespace of its own, each running a Ray
node (`ray start --block`). Nothing listens outside these namespaces: the addresses are in a
private range used only here, and the root namespace has no route to them.

Root is needed (`ip netns add`); `NetnsCluster.available()` says why not where it cannot run.
A run inside host i: `cluster.run(i, [...])`. Host i's Ray node stops with `stop_node(i)` (a
node lost mid-run) and joins again with `start_node(i)`; `cut(i)` takes its link down (a host cut
off: its node and processes stay up) and `reconnect(i)` brings it back. `private={i: [folder]}` gives host i an
empty folder of its own at that path (a tmpfs in its own mount namespace): a filesystem the
other hosts do not share. `close()` stops every node, kills what is left of the processes started
in the namespaces (found by the marker variable they inherit), and deletes the namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rlkit.actors.reaper import carrying

NODE_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster" / "ray-node.sh"
SUBNET = "10.213.7"  # private addresses of the test hosts: 10.213.7.1, .2, ...
PORT = 6379
HEALTH_CHECKS = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "3000",
                 "RAY_health_check_failure_threshold": "3",
                 "RAY_gcs_rpc_server_reconnect_timeout_s": "30"}  # a node gives an unreachable head up after 30 s
MARKER = "RLKIT_TEST_RUN"  # the variable every process started in the hosts carries (its value: the cluster's tag)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetnsCluster:
    def __init__(self, hosts: int = 2, cpus: int | list[int] = 4, resources: dict[int, dict[str, float]] | None = None,
                 env: dict[str, str] | None = None, private: dict[int, list[str]] | None = None,
                 dashboard: bool = False, cwd: str | Path | None = None):
        self.tag = f"rlk{uuid.uuid4().hex[:6]}"
        self.cwd = cwd  # where the Ray nodes (and so every actor) work: not the driver's folder, as on a cluster
        self.hosts, self.resources, self.private = hosts, resources or {}, private or {}
        self.dashboard = dashboard  # on the head, at 127.0.0.1:8265 inside host 0: `ray job submit` there
        self.cpus = cpus if isinstance(cpus, list) else [cpus] * hosts
        self.names = [f"{self.tag}h{i}" for i in range(hosts)]
        self.switch = f"{self.tag}sw"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.head = f"{self.addresses[0]}:{PORT}"
        self.temp = Path(f"/tmp/{self.tag}-ray")
        self.logs = Path(f"/tmp/{self.tag}-logs")  # each Ray node's own output
        self.env = {**os.environ, MARKER: self.tag, "RAY": str(Path(sys.executable).parent / "ray"),
                    "RLKIT_RAY_PORT": str(PORT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
                    # token authentication on, as `ray start` turns it on where a token exists; this cluster's own token
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex * 2,
                    # the head gives a node up after 3 missed health checks 2 s apart, each waited on for 3 s
                    # (Ray's defaults: 5, 3 s, 10 s), as an operator may set it: a lost or cut-off host is
                    # found in about 6 or 15 s instead of 15 or 65, and a node must be silent 9 s to be lost;
                    # a node's processes wait 30 s for an unreachable head (Ray's default: 60)
                    **HEALTH_CHECKS, **(env or {})}
        self.nodes: dict[int, subprocess.Popen] = {}

    @staticmethod
    def available() -> str | None:
        """None where namespaces can be made here, else why not."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"rlkprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    # ------------------------------------------------------------------ network

    def _netns(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    # ------------------------------------------------------------------ ray

    def _ray_start(self, i: int) -> subprocess.Popen:
        """Host i's Ray node, started as users start theirs: scripts/cluster/ray-node.sh."""
        args = ["bash", str(NODE_SCRIPT), "head" if i == 0 else "worker", *([] if i == 0 else [self.head]),
                "--block", f"--node-ip-address={self.addresses[i]}", f"--num-cpus={self.cpus[i]}"]
        if self.resources.get(i):
            args.append(f"--resources={json.dumps(self.resources[i])}")
        if i == 0:
            args += [f"--include-dashboard={str(self.dashboard).lower()}", f"--temp-dir={self.temp}"]
        if self.private.get(i):  # folders host i does not share: an empty tmpfs over each, in its own mounts
            mounts = " && ".join(f"mkdir -p {shlex.quote(d)} && mount -t tmpfs rlkit-private {shlex.quote(d)}"
                                 for d in self.private[i])
            args = ["sh", "-c", f"{mounts} && exec {shlex.join(args)}"]
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"node{i}.log", "ab")  # noqa: SIM115 - the node's lifetime
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd)

    def start_node(self, i: int) -> None:
        """Host i's Ray node joins again (after `stop_node(i)`)."""
        self.nodes[i] = self._ray_start(i)
        self._wait_nodes(len(self.nodes))

    def start(self) -> NetnsCluster:
        self._netns()
        self.nodes[0] = self._ray_start(0)
        self._wait_nodes(1)
        for i in range(1, self.hosts):
            self.nodes[i] = self._ray_start(i)
        self._wait_nodes(self.hosts)
        return self

    def _wait_nodes(self, n: int, timeout_s: float = 120) -> None:
        code = (f"import ray; ray.init(address={self.head!r}, logging_level='ERROR'); "
                "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.run(0, [sys.executable, "-c", code], timeout=60, check=False)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster has not {n} Ray nodes after {timeout_s} s: {out.stderr[-2000:]}")
            time.sleep(1)

    def run(self, i: int, cmd: list[str], timeout: float = 900, check: bool = False,
            **kw: Any) -> subprocess.CompletedProcess:
        """`cmd` inside host i, with the marker in its environment."""
        env = {**self.env, **kw.pop("env", {})}
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], env=env, capture_output=True, text=True,
                              timeout=timeout, check=check, **kw)

    def popen(self, i: int, cmd: list[str], **kw: Any) -> subprocess.Popen:
        env = {**self.env, **kw.pop("env", {})}
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], env=env, **kw)

    def stop_node(self, i: int) -> None:
        """Host i's Ray node goes away (its `ray start --block` and what it started)."""
        node = self.nodes.pop(i)
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        self._kill_marked(lambda ns: ns == self.names[i])

    def cut(self, i: int) -> None:
        """Host i is cut off from the network (its link down): its Ray node and processes stay up."""
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def reconnect(self, i: int) -> None:
        """Host i's link is up again (after `cut(i)`; Ray has marked its node dead: `stop_node`, `start_node`)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up")

    def processes(self, i: int) -> dict[int, str]:
        """{pid: command line} of this cluster's processes in host i's namespace."""
        out = {}
        for pid in carrying(self.tag, MARKER):
            if _netns_of(pid) != self.names[i]:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # gone
                continue
        return out

    # ------------------------------------------------------------------ teardown

    def _kill_marked(self, where: Any = lambda ns: True) -> None:
        """SIGKILL every process that carries this cluster's marker and runs in a namespace `where` accepts."""
        for pid in carrying(self.tag, MARKER):
            if where(_netns_of(pid)):
                with contextlib.suppress(OSError):  # already gone
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(OSError):
                os.killpg(node.pid, signal.SIGTERM)
        for node in self.nodes.values():
            try:
                node.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        self.nodes.clear()
        self._kill_marked()
        for name in (*self.names, self.switch):
            _ip("netns", "del", name, check=False)
        shutil.rmtree(self.temp, ignore_errors=True)
        shutil.rmtree(self.logs, ignore_errors=True)


def _netns_of(pid: int) -> str | None:
    """The name of the network namespace process `pid` runs in (None: the root one, or unnamed)."""
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
        try:
            if os.stat(f"/run/netns/{name}").st_ino == inode:
                return name
        except OSError:
            continue
    return None
