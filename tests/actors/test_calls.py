"""Waiting on Ray actor calls: a deadline that names the late actor and the phase, fail-fast on
the first error, and an actor's user-facing error coming out as one line."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlkit.errors import FaultError, UserError

pytestmark = pytest.mark.slow


class _Worker:
    def run(self, seconds: float, value: int) -> int:
        time.sleep(seconds)
        return value

    def pid(self) -> int:
        return os.getpid()

    def relay(self, other: object) -> int:  # a learner sending to an engine
        import ray

        return ray.get(other.run.remote(60, 0))

    def fail(self, user: bool) -> None:
        if user:
            raise FaultError("engine 3 went out of sync")
        raise ValueError("a bug")


def test_wait_all_names_late_actors_and_fails_fast(ray_local):
    import ray

    from rlkit.actors.calls import wait_all

    actors = [ray.remote(_Worker).options(num_cpus=0.1).remote() for _ in range(3)]
    owners = [f"engine {i}" for i in range(3)]
    assert wait_all([a.run.remote(0.2 * (3 - i), i) for i, a in enumerate(actors)], owners, "x", 30) == [0, 1, 2]

    t0 = time.monotonic()
    with pytest.raises(FaultError, match=r"^engine 1 \(and engine 2\) did not finish the weight sync within 1\.5 s "
                                         r"\(rollout.sync_timeout_s\); .*raise rollout.sync_timeout_s$") as e:
        wait_all([actors[0].run.remote(0, 0), actors[1].run.remote(60, 1), actors[2].run.remote(60, 2)],
                 owners, "the weight sync", 1.5)
    assert e.value.who == ["engine 1", "engine 2"] and not e.value.dead
    assert time.monotonic() - t0 < 10
    for a in actors[1:]:
        ray.kill(a)

    # The first failure ends the wait although another call would run for a minute; an actor's
    # user-facing error is itself (one line), a bug keeps Ray's error and traceback.
    t0 = time.monotonic()
    with pytest.raises(FaultError) as e:
        wait_all([actors[0].fail.remote(True), _slow().remote()], owners[:2], "x")
    assert str(e.value) == "engine 3 went out of sync" and type(e.value) is FaultError
    assert time.monotonic() - t0 < 10
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        wait_all([actors[0].fail.remote(False)], owners[:1], "x")
    assert not isinstance(e.value, UserError) and "a bug" in str(e.value)


def _slow():
    import ray

    @ray.remote(num_cpus=0.1)
    def slow() -> int:
        time.sleep(60)
        return 0

    return slow


class _Refuses:
    def __init__(self):
        raise ValueError("The model's max seq len (2048) is larger than the maximum number of tokens that can be "
                         "stored in KV cache (1024)")

    def ready(self) -> bool:
        return True


def test_an_actor_whose_start_fails_says_what_its_library_said(ray_local):
    """An engine whose constructor raises (vLLM refusing a recipe value rlkit cannot check before
    launch): the line names it and ends with the library's message, not only "its start failed"."""
    import ray

    from rlkit.actors.calls import name_actor, wait_all

    engine = ray.remote(_Refuses).options(num_cpus=0.1).remote()
    name_actor(engine, "engine 0")
    with pytest.raises(FaultError, match=r"^engine 0 died during its start \(.*its start failed: The model's max seq "
                                         r"len \(2048\) is larger than the maximum number of tokens that can be "
                                         r"stored in KV cache \(1024\)\)$"):
        wait_all([engine.ready.remote()], ["engine 0"], "its start")


def test_a_dead_actor_is_named_with_its_pid_and_node_also_through_another_actor(ray_local):
    """kill -9 of an actor mid-call: one line naming it (by the name rlkit gave it, also when its
    death reaches the driver through another actor's call), its pid, node and the phase."""
    import ray

    from rlkit.actors.calls import name_actor, wait_all

    engine, other, learner = (ray.remote(_Worker).options(num_cpus=0.1).remote() for _ in range(3))
    for handle, name in ((engine, "engine 1"), (other, "engine 2"), (learner, "learner 0")):
        name_actor(handle, name)
    pids = ray.get([engine.pid.remote(), other.pid.remote()])
    direct, relayed = engine.run.remote(60, 0), learner.relay.remote(other)
    time.sleep(1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(FaultError, match=rf"^engine 1 died during the generation \(pid {pids[0]}, node [\d.]+; "
                                         r"its process exited unexpectedly: killed \(the OOM killer, kill -9\) "
                                         r"or crashed\)$"):
        wait_all([direct], ["engine 1"], "the generation")
    with pytest.raises(FaultError, match=rf"^engine 2 died during the weight sync \(pid {pids[1]}, node ") as e:
        wait_all([relayed], ["learner 0"], "the weight sync")
    assert e.value.who == ["engine 2"] and e.value.dead  # whom to restart (an ActorFault)
    assert time.monotonic() - t0 < 30
    ray.kill(learner)


def test_a_worker_killed_by_rays_memory_monitor_is_one_line(monkeypatch):
    """Ray's OutOfMemoryError (a call's worker killed above the node's memory threshold), raised
    directly or through the call of another actor, is a fault in one line, not Ray's traceback."""
    import ray

    from rlkit.actors import calls

    text = ("1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, "
            "ID: ee6f) was 22.85GB used / 23.54GB limit (0.970630)\nOOM kill reason: ...\nTop 10 memory users: ...")
    oom = ray.exceptions.OutOfMemoryError(text)
    for raised in (oom, ray.exceptions.RayTaskError("push_weights", "traceback", oom)):
        def get(ref, error=raised):
            raise error
        monkeypatch.setattr(ray, "get", get)
        with pytest.raises(calls.ActorFault) as e:
            calls._get(object(), "learner 0", "the weight sync")
        assert str(e.value) == ("learner 0 failed during the weight sync: Ray's memory monitor killed a worker: the "
                                "node used 22.85GB of 23.54GB; see which process grew in the run's logs/ (and its "
                                "metrics' memory/*), then free memory on the node or lower what a step takes (rlkit "
                                "estimate RECIPE shows it by part)")
        assert "\n" not in str(e.value)


def test_an_actor_cut_off_with_its_node_is_the_nodes_line(monkeypatch):
    """A call to an actor on a node that is going away breaks off ("temporarily unavailable")
    seconds before Ray marks the node dead: the wait gives Ray that time, so the line names the
    node; an actor whose process died on a live node is reported at once."""
    import ray

    from rlkit.actors import calls

    actor = ray.ActorID.from_random()
    monkeypatch.setattr(calls, "_names", {actor.hex(): "learner 0"})
    monkeypatch.setattr(calls, "_hosted", {"node-b": {"learner 0": "10.213.7.2"}})
    monkeypatch.setattr(calls, "NODE_CHECK_S", 0.05)
    asked = []

    def nodes():  # node B is alive for Ray's first five answers, then dead
        asked.append(1)
        return [{"NodeID": "node-b", "Alive": len(asked) <= 5}]

    monkeypatch.setattr(ray, "nodes", nodes)
    cut = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: RpcError: Socket closed",
                                               actor.binary())

    def get(ref):
        raise cut

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(calls.NodeLost, match=r"^Ray node 10.213.7.2 left the cluster during the weight sync "
                                             r"\(it hosted learner 0\)"):
        calls._get(object(), "learner 0", "the weight sync")
    assert len(asked) == 6
    # a process that died where its node lives: no wait, the actor's line
    asked.clear()
    monkeypatch.setattr(calls, "PEER_NODE_WAIT_S", 30.0)
    died = ray.exceptions.ActorDiedError()
    died.actor_id = actor.hex()

    def get_died(ref):
        raise died

    monkeypatch.setattr(ray, "get", get_died)
    t = time.monotonic()
    with pytest.raises(calls.ActorFault, match=r"^learner 0 died during the weight sync"):
        calls._get(object(), "learner 0", "the weight sync")
    assert time.monotonic() - t < 1.0 and len(asked) == 1
