"""A model the driver calls from Ray actors of its own (a reward model, an LLM judge's engines):
started as every Ray role rlkit starts (`roles.Role`), named in fault messages, on the
accelerator's own resource (`GPU`, `NPU`), with a deadline on every call (`calls.wait_all`).

Without Ray (a test, `rlkit reward test`) the same class runs in the caller's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlkit.accel import DeviceInfo, of_kind
from rlkit.errors import UserError


@dataclass(frozen=True)
class Serving:
    """Where a served model runs and how long its calls may take.

    device: the device kind of its actors ("cpu", "cuda", "rocm", "npu"; "auto": the driver's).
    devices: devices per actor on an accelerator (none on a CPU). cpus: Ray CPUs per actor.
    resources: Ray custom resources per actor (`{rm: 1}`: the node started with them).
    actors: how many. ray: in Ray actors when Ray is running (False: always in-process).
    timeout_s / start_timeout_s: the longest a call / the model's start may take (0: no limit).
    what: the recipe's words for it in messages ("the reward model").
    """

    device: str = "cpu"
    devices: float = 1
    cpus: float = 1
    resources: dict[str, float] = field(default_factory=dict)
    actors: int = 1
    ray: bool = True
    timeout_s: float = 600
    start_timeout_s: float = 900
    what: str = "the served model"

    def __post_init__(self) -> None:
        if self.actors < 1:
            raise UserError(f"{self.what}: needs at least one actor, got {self.actors}")
        if self.devices < 0 or self.cpus < 0:
            raise UserError(f"{self.what}: devices and num_cpus must be >= 0, got {self.devices}, {self.cpus}")

    @property
    def info(self) -> DeviceInfo:
        return of_kind(self.device)

    def names(self) -> list[str]:
        return [self.what] if self.actors == 1 else [f"{self.what} {i}" for i in range(self.actors)]

    def bundle(self) -> dict[str, float]:
        """What one actor asks of the Ray cluster (checked before launch with the run's roles)."""
        from rlkit.actors.placement import bundle

        return {k: float(v) for k, v in bundle(self.info, self.cpus, self.devices, self.resources).items() if v}

    def in_ray(self) -> bool:
        """Whether its actors start now: asked for, and Ray is running in this process."""
        if not self.ray:
            return False
        import ray

        return ray.is_initialized()

    def start(self, cls: type, *args: Any, env: dict[str, str] | None = None, indexed: bool = False,
              **kwargs: Any) -> list[Any]:
        """`actors` actors of `cls(*args, **kwargs)` (and `index=i` for actor i when `indexed`); one
        line first if the cluster lacks what they ask for (Ray would wait for it forever)."""
        import ray

        from rlkit.actors.placement import actor_resources, worker_env
        from rlkit.actors.roles import Role

        has = ray.cluster_resources()
        needs = {k: v * self.actors for k, v in self.bundle().items()}
        short = {k: v for k, v in needs.items() if has.get(k, 0) < v}
        if short:
            asks = "actor needs" if self.actors == 1 else "actors need"
            raise UserError(f"{self.what}'s {asks} {_res(short)}; the cluster has "
                            f"{_res({k: has.get(k, 0) for k in short})} (start a node with them, or change devices / "
                            "num_cpus / resources)")
        info = self.info  # a CPU kind asks for no device (`actor_resources`)
        role = Role(cls, actor_resources(info, self.cpus, self.devices, self.resources), worker_env(info, env))
        return [role.start(*args, name=name, **({"index": i} if indexed else {}), **kwargs)
                for i, name in enumerate(self.names())]

    def wait(self, refs: list[Any], owners: list[str], phase: str, start: bool = False) -> list[Any]:
        """The results of calls on its actors, or a one-line fault naming the actor past its deadline."""
        from rlkit.actors.calls import wait_all

        limit = self.start_timeout_s if start else self.timeout_s
        return wait_all(refs, owners, phase, limit or None, knob=f"{self.what}'s "
                        f"{'start_timeout_s' if start else 'timeout_s'}")


def _res(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"
