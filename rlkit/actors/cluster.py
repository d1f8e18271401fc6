"""What a run asks of the Ray cluster, checked before any actor starts.

- `check_resources`: the learners' and engines' placement groups must fit the nodes that are
  alive (a placement group that cannot fit waits forever in Ray); one line says what is missing
  and what the cluster has.
- `check_nodes_see`: every node that hosts a learner must see `output_dir` (DeepSpeed ranks
  write their shards there) and `model.path`, and every engine's node `model.path`.
- `interface_env`: the network interface that holds this node's address, for the learners'
  process group (gloo, NCCL or HCCL: the device's own variable), which otherwise binds to what the
  host name resolves to, often 127.0.0.1.

`shortfall` is pure (node resources in, a message or None out) and tested without Ray.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import UserError

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


@dataclass(frozen=True)
class Demand:
    """`n` bundles of `bundle` resources for `what` ("learner", "engine"), placed by `placement`
    (a `ray.placement` value); `key` is the recipe key that sets `n`."""

    what: str
    n: int
    bundle: dict[str, float]
    placement: str = "pack"
    key: str = ""
    custom: tuple[str, ...] = ()  # the bundle's custom resources
    custom_key: str = ""  # the recipe key that sets them (default: ray.resources.<what>)

    def describe(self) -> str:
        return f"{self.n} {self.what}{'s' if self.n != 1 else ''} x {_res(self.bundle)} ({self.placement})"


def _res(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _fits(free: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items())


def _take(free: dict[str, float], bundle: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def shortfall(demands: Sequence[Demand], nodes: dict[str, dict[str, float]]) -> str | None:
    """None when the demands can be placed on `nodes` (node address -> total resources), else
    what does not fit. Bundles go first-fit onto the nodes in order, a whole strict_pack group on
    one node, a strict_spread group's bundles on distinct nodes."""
    free = {name: dict(res) for name, res in nodes.items()}
    for d in demands:
        wanted = set(d.bundle)
        totals = {k: sum(n.get(k, 0.0) for n in nodes.values()) for k in wanted}
        asked = {k: sum(x.n * x.bundle.get(k, 0.0) for x in demands) for k in wanted}
        short = [f"{k} {asked[k]:g} in all, the cluster has {totals[k]:g}" for k in sorted(wanted)
                 if asked[k] > totals[k] + 1e-9]
        if short:
            return "; ".join(short)
        if not any(_fits(res, d.bundle) for res in nodes.values()):
            return f"no node holds one {d.what}'s bundle {_res(d.bundle)}"
        if d.placement == "strict_pack":
            whole = {k: v * d.n for k, v in d.bundle.items()}
            home = next((name for name, res in free.items() if _fits(res, whole)), None)
            if home is None:
                return f"placement strict_pack needs one node with {_res(whole)} for the {d.what}s"
            _take(free[home], whole)
            continue
        used: set[str] = set()
        for _ in range(d.n):
            home = next((name for name, res in free.items()
                         if _fits(res, d.bundle) and not (d.placement == "strict_spread" and name in used)), None)
            if home is None:
                if d.placement == "strict_spread":
                    return f"placement strict_spread needs {d.n} nodes that each hold {_res(d.bundle)}"
                return (f"the {d.what}s' bundles {_res(d.bundle)} do not fit whole on the nodes' remaining "
                        "resources")
            _take(free[home], d.bundle)
            used.add(home)
    return None


def cluster_nodes() -> dict[str, dict[str, float]]:
    """The alive Ray nodes: address -> total resources (CPU, GPU, NPU, custom; no memory keys)."""
    import ray

    out: dict[str, dict[str, float]] = {}
    for node in sorted(ray.nodes(), key=lambda n: n.get("NodeManagerAddress", "")):
        if node.get("Alive"):
            res = {k: float(v) for k, v in node.get("Resources", {}).items()
                   if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
            name = node.get("NodeManagerAddress", node.get("NodeID", "?"))
            while name in out:
                name += "'"
            out[name] = res
    return out


def check_resources(demands: Sequence[Demand]) -> None:
    """A one-line `UserError` before launch when the cluster cannot hold `demands`."""
    nodes = cluster_nodes()
    has = "; ".join(f"node {name}: {_res(res)}" for name, res in nodes.items()) or "no alive node"
    for d in demands:
        for name in d.custom:
            if not any(name in res for res in nodes.values()):
                raise UserError(f"the {d.what}s ask for {name} {d.bundle[name]:g} each and no node of the Ray "
                                f"cluster has {name} ({has}): start a node with ray start --resources='{{\"{name}\": "
                                "N}', or remove it", d.custom_key or f"ray.resources.{d.what}")
    missing = shortfall(demands, nodes)
    if missing is None:
        return
    raise UserError(f"the Ray cluster cannot place this run: it asks for {' + '.join(d.describe() for d in demands)}; "
                    f"{missing} ({has}). Lower {' or '.join(d.key for d in demands if d.key) or 'what it asks'}, "
                    "choose another ray.placement, or add nodes")


# ---------------------------------------------------------------------------------- shared paths


def _sees(paths: dict[str, tuple[str, str | None]]) -> tuple[str, list[str]]:
    """On a node: for each key, whether its path exists there (and, with a marker name, that the
    marker the driver wrote is there). Returns (node address, what it does not see)."""
    import os

    import ray

    missing = []
    for key, (path, marker) in paths.items():
        if marker is not None:
            if not os.path.isfile(os.path.join(path, marker)):
                missing.append(f"{key} {path} (not the driver's: a marker written there is missing)")
        elif not os.path.exists(path):
            missing.append(f"{key} {path} (does not exist there)")
    return ray.util.get_node_ip_address(), missing


def pg_nodes(pg: Any) -> set[str]:
    """Node ids of a ready placement group's bundles."""
    from ray.util.placement_group import placement_group_table

    return set(placement_group_table(pg).get("bundles_to_node_id", {}).values())


def check_nodes_see(node_ids: set[str], who: str, output_dir: Path | None = None,
                    model_path: str | None = None) -> None:
    """Each node in `node_ids` other than the driver's must see `output_dir` (the driver writes a
    marker there and the node looks for it) and `model_path` (a local path: it must exist there).
    A one-line `UserError` names the node and the path."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    others = node_ids - {ray.get_runtime_context().get_node_id()}
    paths: dict[str, tuple[str, str | None]] = {}
    if model_path and Path(model_path).exists():  # a hub id is fetched on each node
        paths["model.path"] = (str(Path(model_path).resolve()), None)
    marker = None
    if output_dir is not None:
        output_dir = output_dir.resolve()
        output_dir.mkdir(parents=True, exist_ok=True)
        marker = output_dir / f".rlkit-node-check-{uuid.uuid4().hex[:12]}"
        marker.write_text("rlkit\n")
        paths["output_dir"] = (str(output_dir), marker.name)
    if not others or not paths:
        if marker is not None:
            marker.unlink(missing_ok=True)
        return
    remote = ray.remote(num_cpus=0, max_retries=0)(_sees)
    try:
        answers = ray.get([remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                           .remote(paths) for node in sorted(others)], timeout=120)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    for address, missing in answers:
        if missing:
            raise UserError(f"Ray node {address} (it hosts {who}) does not see {missing[0]}: every node that hosts "
                            "learners or engines must see output_dir and model.path at the same path (a shared "
                            "filesystem such as NFS; see docs/clusters.md)")


# ---------------------------------------------------------------------------------- user modules


def installed(module: Any) -> bool:
    """Whether a module comes with the Python environment (an installed distribution's package,
    the standard library, site-packages): every node of the cluster has it."""
    import importlib.metadata
    import sys
    import sysconfig

    if module.__name__.split(".")[0] in importlib.metadata.packages_distributions():
        return True
    real = Path(module.__file__).resolve()
    roots = {sys.prefix, sys.base_prefix, sysconfig.get_paths()["stdlib"]}
    return "site-packages" in real.parts or "dist-packages" in real.parts or any(
        real.is_relative_to(Path(r).resolve()) for r in roots)


def ship_by_value(modules: Sequence[Any]) -> list[str]:
    """Modules of the user's own files (a reward module next to the recipe, not installed) are
    pickled by value from now on, so an actor or a task that uses their classes or functions
    runs on any node, which has not the file on its Python path. Returns their files."""
    from ray import cloudpickle

    shipped = []
    for module in modules:
        path = getattr(module, "__file__", None)
        if path is None or installed(module):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError as e:  # a module that is not in sys.modules under its name
            raise UserError(f"{module.__name__} ({path}) cannot be sent to the cluster's nodes: {e}; install it "
                            "on every node (pip install -e) instead") from None
        shipped.append(path)
    return shipped


# ---------------------------------------------------------------------------------- rendezvous


def rendezvous() -> tuple[str, int]:
    """(this node's Ray address, a free TCP port there): where rank 0 hosts a process group that
    ranks on other nodes join; never localhost, which each node resolves to itself. The port is
    drawn below the kernel's ephemeral range, so that no outgoing connection (Ray's own, by the
    hundred) takes it between this check and the process group's bind; the kernel's pick if none
    there is free."""
    import random
    import socket

    import ray

    address = ray.util.get_node_ip_address()
    low = _ephemeral_start()
    for port in random.Random().sample(range(PORTS_FROM, low), min(32, max(0, low - PORTS_FROM))):
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return address, port
    with socket.socket() as s:
        s.bind((address, 0))
        return address, s.getsockname()[1]


PORTS_FROM = 20000  # rendezvous ports are drawn from here up to the ephemeral range


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's /proc; its default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def interface_env(var: str = "GLOO_SOCKET_IFNAME") -> dict[str, str]:
    """``var`` (the device's `socket_ifname_var`: gloo's, NCCL's or HCCL's) for this process, unless
    set: the interface holding the node's Ray address (the process group binds to what the host
    name resolves to otherwise, often 127.0.0.1, which the other nodes cannot reach)."""
    import os

    import ray

    if os.environ.get(var):
        return {}
    name = interface_of(ray.util.get_node_ip_address())
    return {var: name} if name else {}


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host (None: none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None
