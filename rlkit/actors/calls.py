"""Waiting on Ray actor calls with a deadline, so that a hung actor becomes a one-line error
naming it and the phase, not a run that waits forever.

`wait_all` also fails fast: the first call that raises ends the wait (the others may be stuck
in a collective with the failed one), and a user-facing error raised inside an actor comes out
as itself, without Ray's remote traceback. An actor that died (killed, out of memory, its node
lost) comes out as a `FaultError` naming it, its pid and node; the actor is named by the name
`name_actor` gave it, also when the death surfaces through another actor's call (an engine
that dies while a learner sends it weights). Ray's full error is the `FaultError`'s cause.
Both kinds are an `ActorFault`, which says whom it is about, so a caller that can replace the
actor (the rollout engines restart a dead or hung engine) knows which. A node that hosted
rlkit's actors (`watch_nodes`) and left the cluster is a `NodeLost` instead, found within a few
seconds by any wait: nothing can be restarted there, and a learner left in a collective with a
rank on that node would wait for the process group's timeout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlkit.errors import FaultError, UserError

POLL_S = 1.0  # the longest a wait blocks without returning to Python (signal handlers run between)
NODE_CHECK_S = 2.0  # how often a wait asks Ray whether the nodes of rlkit's actors are alive
PEER_NODE_WAIT_S = 60.0  # how long a collective that lost its peer waits for Ray to find a lost node
PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker (crash|hang)|NCCL (error|WARN)|HCCL|"
                       r"Connection refused|Broken pipe", re.I)
NODE_GONE = re.compile(r"node (has )?died|node was removed|temporarily unavailable", re.I)
_names: dict[str, str] = {}  # Ray actor id (hex) -> "engine 1", "learner 0"
_hosted: dict[str, dict[str, str]] = {}  # Ray node id -> {actor name: node address} of rlkit's actors there
_next_node_check = 0.0


class ActorFault(FaultError):
    """Named actors died (`dead`) or did not answer in time (hung); `who` are their names
    ("engine 1"). Kept through Ray's pickling of an actor's error (the attributes ride in the
    instance dict)."""

    def __init__(self, message: str, who: Sequence[str] = (), dead: bool = False):
        super().__init__(message)
        self.who, self.dead = list(who), dead


class NodeLost(FaultError):
    """A Ray node that hosted rlkit's actors left the cluster: nothing can be restarted in its
    bundles, so the run stops (its checkpoints are intact)."""


def name_actor(handle: Any, name: str) -> None:
    """Name the actor behind `handle` in fault messages ("engine 1")."""
    _names[handle._actor_id.hex()] = name


def watch_nodes(pg: Any, names: Sequence[str]) -> None:
    """Bundle i of placement group `pg` hosts the actor `names[i]`: a wait fails with `NodeLost`
    when that bundle's node is gone. Called again for the same names, the newer placement counts."""
    import ray
    from ray.util.placement_group import placement_group_table

    where = placement_group_table(pg).get("bundles_to_node_id", {})
    address = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    for hosted in _hosted.values():
        for name in names:
            hosted.pop(name, None)
    for i, name in enumerate(names):
        if i in where:
            _hosted.setdefault(where[i], {})[name] = address.get(where[i], where[i][:12])


def unwatch_nodes(names: Sequence[str]) -> None:
    for hosted in _hosted.values():
        for name in names:
            hosted.pop(name, None)


def check_nodes(phase: str, force: bool = False) -> None:
    """A `NodeLost` naming the node and what it hosted if a node of rlkit's actors is dead
    (asks Ray at most every `NODE_CHECK_S` seconds unless `force`)."""
    global _next_node_check
    if not any(_hosted.values()) or (not force and time.monotonic() < _next_node_check):
        return
    import ray

    _next_node_check = time.monotonic() + NODE_CHECK_S
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for node, hosted in _hosted.items():
        if hosted and node not in alive:
            address = next(iter(hosted.values()))
            raise NodeLost(f"Ray node {address} left the cluster during {phase} (it hosted {', '.join(hosted)}): "
                           "the run stops. When the node is back (or the cluster has its resources again), run the "
                           "same command: resume: auto continues from the last checkpoint")


def wait_all(futures: Sequence[Any], owners: Sequence[str], phase: str, timeout_s: float | None = None,
             knob: str = "rollout.sync_timeout_s") -> list[Any]:
    """The results of `futures` (Ray object refs) in order; `owners[i]` names who runs
    `futures[i]` ("engine 1"). A `FaultError` if some are not done `timeout_s` seconds from now
    (None or 0: no limit); `knob` is the recipe key that sets the limit."""
    import ray

    index = {ref: i for i, ref in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    pending = list(futures)
    while pending:
        left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            check_nodes(phase)
            if deadline is None or time.monotonic() < deadline:
                continue  # a poll ran out, the deadline has not
            raise overdue(sorted({owners[index[ref]] for ref in pending}, key=owners.index), phase, timeout_s, knob)
        for ref in ready:
            results[index[ref]] = _get(ref, owners[index[ref]], phase)
    return results


def overdue(late: list[str], phase: str, timeout_s: float, knob: str = "rollout.sync_timeout_s") -> ActorFault:
    """The fault of actors `late` ("engine 1") that did not finish `phase` within `timeout_s` (`knob`)."""
    who = late[0] + (f" (and {', '.join(late[1:])})" if len(late) > 1 else "")
    return ActorFault(f"{who} did not finish {phase} within {timeout_s:g} s ({knob}); "
                      f"it is hung or far slower than expected: see its log, or raise {knob}", late)


@dataclass(frozen=True)
class Started:
    """Calls sent (Ray refs, who runs each, the phase errors name): calling it waits for their results
    (`wait_all`); `done` asks without waiting."""

    refs: list[Any]
    owners: list[str]
    phase: str
    timeout_s: float | None = None

    def __call__(self) -> list[Any]:
        return wait_all(self.refs, self.owners, self.phase, self.timeout_s)

    def done(self) -> bool:
        import ray

        return len(ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[0]) == len(self.refs)


def _get(ref: Any, owner: str, phase: str) -> Any:
    """`ray.get`; an actor's `UserError` is raised as itself (one line), a dead actor as an
    `ActorFault` (see the module doc), other errors as Ray's."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        _await_lost_node(e, owner, phase)
        raise ActorFault(died(e, owner, phase), [_actor_name(e, owner)], dead=True) from e
    except ray.exceptions.OutOfMemoryError as e:
        raise ActorFault(out_of_memory(e, owner, phase), [owner], dead=True) from e
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserError):
            raise e.cause from None
        if isinstance(e.cause, ray.exceptions.RayActorError):  # e.g. an engine, from a learner's call
            _await_lost_node(e.cause, owner, phase)
            raise ActorFault(died(e.cause, owner, phase), [_actor_name(e.cause, owner)], dead=True) from e
        if isinstance(e.cause, ray.exceptions.OutOfMemoryError):  # a worker it called was killed
            raise ActorFault(out_of_memory(e.cause, owner, phase), [owner], dead=True) from e
        if PEER_LOST.search(str(e.cause)):  # a collective whose peer went away: its node, if that is why
            _wait_for_node_loss(phase)
            reason = " ".join(str(e.cause).split())[:200]
            raise FaultError(f"{owner} failed during {phase}: a peer in its process group went away ({reason}); "
                             "see the other actors' logs in the run's logs/") from e
        raise


def _await_lost_node(error: Any, owner: str, phase: str) -> None:
    """A call that broke off from an actor on a watched node (unreachable, or its node gone) is
    often the first sign of a lost node, seconds before Ray marks the node dead: wait for Ray's
    verdict, up to `PEER_NODE_WAIT_S`, so that the line names the node (`NodeLost`). An actor
    whose process died on a live node (Ray's `ActorDiedError`) is reported at once."""
    import ray

    check_nodes(phase, force=True)
    text = getattr(error, "error_msg", "") or str(error)
    if not (isinstance(error, ray.exceptions.ActorUnavailableError) or NODE_GONE.search(text)):
        return
    name = _actor_name(error, owner)
    if any(name in hosted for hosted in _hosted.values()):
        _wait_for_node_loss(phase)


def _wait_for_node_loss(phase: str) -> None:
    """Ask Ray every `NODE_CHECK_S`, for up to `PEER_NODE_WAIT_S`, whether a node of rlkit's
    actors is gone (`NodeLost` if so); returns when the time is up and every node lives."""
    deadline = time.monotonic() + PEER_NODE_WAIT_S
    while True:
        check_nodes(phase, force=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(NODE_CHECK_S)


def _actor_name(error: Any, owner: str) -> str:
    """The name of the actor a `RayActorError` is about (`name_actor`'s), else `owner`."""
    return _names.get(getattr(error, "actor_id", None) or "", owner)


def out_of_memory(error: Any, owner: str, phase: str) -> str:
    """One line on a call that Ray's memory monitor ended (it kills workers above ~95% of the
    node's memory): the node's figures from the error, where to look, what to do."""
    text = str(error)
    used = re.search(r"was ([\d.]+\s*GB) used / ([\d.]+\s*GB) limit", text)
    figures = f": the node used {used[1]} of {used[2]}" if used else ""
    return (f"{owner} failed during {phase}: Ray's memory monitor killed a worker{figures}; see which process grew "
            "in the run's logs/ (and its metrics' memory/*), then free memory on the node or lower what a step "
            "takes (rlkit estimate RECIPE shows it by part)")


def died(error: Any, owner: str, phase: str) -> str:
    """One line on a Ray actor's death: who (named by `name_actor`, else `owner`), its pid and
    node, and why, from the `RayActorError`'s text."""
    text = getattr(error, "error_msg", "") or str(error)
    fields = dict(re.findall(r"^\s*(class_name|pid|ip): (.+)$", text, re.M))
    where = ", ".join(([f"pid {fields['pid']}"] if "pid" in fields else [])
                      + ([f"node {fields['ip']}"] if "ip" in fields else []))
    if "node" in text and ("node has died" in text or "node died" in text or "node was" in text):
        why = "its node died or was removed from the cluster"
    elif "worker process has died" in text or "exits" in text:
        why = "its process exited unexpectedly: killed (the OOM killer, kill -9) or crashed"
    elif getattr(error, "_actor_init_failed", False):  # its constructor raised: the library's own words
        causes = re.findall(r"^(?:[\w.]*(?:Error|Exception)): (.+)$", text, re.M)
        why = "its start failed" + (f": {' '.join(causes[-1].split())[:300]}" if causes else "")
    else:
        why = text.strip().splitlines()[0] if text.strip() else "no reason given by Ray"
    return f"{_actor_name(error, owner)} died during {phase} ({where + '; ' if where else ''}{why})"
