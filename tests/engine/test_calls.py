"""Waiting on Ray actor calls: a deadline that names the late actor and the phase, fail-fast on
the first error, and an actor's user-facing error coming out as one line."""

from __future__ import annotations

import time

import pytest

from rlkit.errors import FaultError, UserError

pytestmark = pytest.mark.slow


class _Worker:
    def run(self, seconds: float, value: int) -> int:
        time.sleep(seconds)
        return value

    def fail(self, user: bool) -> None:
        if user:
            raise FaultError("engine 3 went out of sync")
        raise ValueError("a bug")


def test_wait_all_names_late_actors_and_fails_fast(ray_local):
    import ray

    from rlkit.engine.calls import wait_all

    actors = [ray.remote(_Worker).options(num_cpus=0.1).remote() for _ in range(3)]
    owners = [f"engine {i}" for i in range(3)]
    assert wait_all([a.run.remote(0.2 * (3 - i), i) for i, a in enumerate(actors)], owners, "x", 30) == [0, 1, 2]

    t0 = time.monotonic()
    with pytest.raises(FaultError, match=r"^engine 1 \(and engine 2\) did not finish the weight sync within 1\.5 s "
                                         r"\(rollout.sync_timeout_s\); .*raise rollout.sync_timeout_s$"):
        wait_all([actors[0].run.remote(0, 0), actors[1].run.remote(60, 1), actors[2].run.remote(60, 2)],
                 owners, "the weight sync", 1.5)
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
