"""Every Ray role rlkit starts (the learners, the rollout engines, a distillation teacher) starts
here, one way, and is called one way.

A `Role` is an actor class with what each of its actors asks of Ray (`options`: CPUs, devices,
the role's custom resources) and its environment (the run's `worker_env` over the role's own
variables); `Role.of` makes a run's roles from the recipe's `ray` section. `Role.start` makes
one actor: in a bundle of a placement group, pinned to a node, or anywhere; named for fault
messages (`calls.name_actor`).

`call(handle, Class.method, *args)` sends a call by the method itself, not by its name in a
string: the arguments are checked against the method's signature and the result has its
return type (for a type checker, and for a reader who follows the method), and a renamed
method fails where it is named, at import, not in an actor at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from rlkit.accel import DeviceInfo
from rlkit.actors.calls import name_actor
from rlkit.actors.placement import actor_resources, worker_env
from rlkit.config import RayConfig

if TYPE_CHECKING:
    from ray import ObjectRef

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

NODE_SHARE = 0.001  # of Ray's per-node resource `node:<address>`: pins an actor to that node


@dataclass(frozen=True)
class Role(Generic[T]):
    """One kind of actor: its class, the Ray options of each of its actors (`num_cpus`, `num_gpus`,
    `resources`) and the environment variables its processes start with."""

    cls: type[T]
    options: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, actor: type[T], kind: str, device: DeviceInfo, ray_cfg: RayConfig, devices: int = 1,
           cpus: float | None = None, env: dict[str, str] | None = None) -> Role[T]:
        """`actor` as a run's role `kind` ("learner", "engine", "teacher": its custom resources are
        `ray.resources.<kind>`): `devices` devices of `device`'s kind (none on a CPU), `cpus` CPUs
        (default `ray.cpus_per_actor`), the run's `worker_env` over the role's own `env`."""
        custom = getattr(ray_cfg.resources, kind)
        options = actor_resources(device, ray_cfg.cpus_per_actor if cpus is None else cpus, devices, custom)
        return cls(actor, options, {**(env or {}), **worker_env(device)})

    def start(self, *args: Any, name: str, group: Any = None, bundle: int = 0, node: str | None = None,
              **kwargs: Any) -> Any:
        """One actor of this role, `cls(*args, **kwargs)` in its own process (starting: wait for a
        call to know it is up). Placed in bundle `bundle` of placement group `group`, else on the
        node at address `node`, else where Ray finds room; `name` ("learner 0", "engine 1", "the
        teacher") is how fault messages name it."""
        options = {**self.options, "runtime_env": {"env_vars": dict(self.env)}}
        if group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle)
        elif node:
            options["resources"] = {**options.get("resources", {}), f"node:{node}": NODE_SHARE}
        handle = _remote(self.cls).options(**options).remote(*args, **kwargs)
        name_actor(handle, name)
        return handle


@functools.cache
def _remote(cls: type) -> Any:
    """`cls` as a Ray actor class (made on first use: no Ray work at import)."""
    import ray

    return ray.remote(cls)


def call(handle: Any, method: Callable[Concatenate[Any, P], R], /, *args: P.args,
         **kwargs: P.kwargs) -> ObjectRef[R]:
    """`method(*args, **kwargs)` on the actor behind `handle` (an actor of `method`'s class, or of a
    class with a method of that name and signature): its Ray future."""
    return getattr(handle, method.__name__).remote(*args, **kwargs)
