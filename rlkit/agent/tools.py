"""Tools and environments for multi-turn rollouts, on TRL 1.16's contract (``GRPOTrainer(tools=,
environment_factory=)``, ``trl/trainer/grpo_trainer.py``), so a TRL user's file runs unchanged.

* ``rollout.tools: ["module:function", ...]``: plain functions, sync or ``async``, with type
  hints and a docstring: the model sees each through the schema transformers derives from them
  (``get_json_schema``, what ``apply_chat_template(tools=...)`` renders).
* ``rollout.environment: "module:Factory"`` (or ``{name: "module:Factory"}`` with an
  ``environment`` column per row): a callable that returns an environment; each rollout gets an
  instance of its own (instances are pooled and reused across steps, as TRL does), ``reset(**row)``
  starts it, and its public methods other than ``reset`` / ``get_reward`` are that rollout's tools.
  A ``get_reward()`` (sync or async) is one more reward source, weight 1, named after the class.

Calling tools follows TRL's failure rule: a tool that raises, an unknown tool name or a call of
another type than ``function`` gives ``{"error": "..."}`` as the tool's result and counts as a
failure; rlkit adds a per-call timeout (``rollout.tool_timeout_s``), which fails the same way.
Everything a user can get wrong here is one line before launch.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import ConfigError, RewardError
from rlkit.reward.contract import RewardSpec

NOT_TOOLS = ("reset", "get_reward")


def _import(ref: str, base_dir: str | None, key: str) -> Any:
    """The object `module:name` or `path/to/file.py:name` names (as reward functions are found)."""
    from rlkit.reward.resolve import find_object

    try:
        return find_object(RewardSpec(fn=ref), base_dir, key)[0]
    except RewardError as e:
        raise ConfigError(str(e).replace(f"{key}.fn: ", "", 1), key) from None


def schema(fn: Callable, key: str) -> dict[str, Any]:
    """The JSON schema the chat template shows the model; one line if transformers cannot make it."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 — transformers' DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"tool {name} has no schema the model can see: {e} (a tool needs type hints on every "
                          "argument and a docstring with an Args: section, as in TRL)", key) from None


def tool_methods(instance: Any) -> list[Callable]:
    """An environment's tools: its public functions other than reset / get_reward, bound to it
    (listed on the class, so properties are not evaluated)."""
    return [getattr(instance, n) for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if n not in NOT_TOOLS and not n.startswith("_")]


def load_tools(refs: Sequence[str], base_dir: str | None = None, key: str = "rollout.tools") -> list[Callable]:
    tools, seen = [], {}
    for i, ref in enumerate(refs):
        k = f"{key}[{i}]"
        fn = _import(ref, base_dir, k)
        if inspect.isclass(fn) or not callable(fn):
            raise ConfigError(f"{ref!r} is not a function (an environment class goes to rollout.environment)", k)
        schema(fn, k)
        if fn.__name__ in seen:
            raise ConfigError(f"two tools are named {fn.__name__!r} ({seen[fn.__name__]} and {ref}); the model "
                              "calls tools by name", k)
        seen[fn.__name__] = ref
        tools.append(fn)
    return tools


@dataclass
class Environments:
    """The recipe's environment factories ({None: f} for one), probed at load: each has `reset`,
    its tools have schemas; `rewards` are the (class name, scorer) of those with `get_reward`."""

    factories: dict[str | None, Callable[[], Any]]
    tools: dict[str | None, list[str]]  # tool names per environment
    rewards: list[tuple[str, Callable[..., list[float | None]]]] = field(default_factory=list)
    _pool: dict[str | None, list[Any]] = field(default_factory=dict)
    _lent: set[int] = field(default_factory=set)  # id() of the instances drawn and not yet released
    _lock: threading.Lock = field(default_factory=threading.Lock)
    gym: bool = False  # a gym-style interaction (`load_interaction`), not TRL's environment_factory

    @property
    def multi(self) -> bool:
        return None not in self.factories

    def draw(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """One instance per rollout (row), from the pool; more are made only when the rollouts in
        flight need more at once than exist (generations started ahead of training each hold
        theirs until `release`). Not reset here: `reset(**row)` is the rollout's first step."""
        out = []
        with self._lock:
            for i, row in enumerate(rows):
                name = row.get("environment") if self.multi else None
                if name not in self.factories:
                    raise ConfigError(f"row {i} has environment {name!r}, which rollout.environment does not name "
                                      f"(it names {sorted(n for n in self.factories if n is not None)})",
                                      "environment")
                pool = self._pool.setdefault(name, [])
                free = next((e for e in pool if id(e) not in self._lent), None)
                if free is None:
                    free = self.factories[name]()
                    pool.append(free)
                self._lent.add(id(free))
                out.append(free)
        return out

    def release(self, instances: Sequence[Any] | None) -> None:
        """The rollouts of `instances` are scored: the pool may hand them out again."""
        with self._lock:
            self._lent.difference_update(id(e) for e in instances or ())

    def reset_kwargs(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """What `reset` receives: the row's columns (without the `environment` selector)."""
        return {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)


def _reward_of(cls: type) -> Callable[..., list[float | None]]:
    """The reward source of an environment class with `get_reward`: a rollout of another class scores None."""
    if inspect.iscoroutinefunction(cls.get_reward):
        async def get_reward(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
            return [await e.get_reward() if type(e) is cls else None for e in environments]
    else:
        def get_reward(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
            return [e.get_reward() if type(e) is cls else None for e in environments]
    get_reward.__name__ = get_reward.__qualname__ = cls.__name__
    return get_reward


def _probe(ref: str | Mapping[str, str], base_dir: str | None, key: str):
    """(name, key, factory, instance) for each factory `ref` names ({None: ref} for one), each
    called once to probe it (the instance seeds the pool)."""
    refs: dict[str | None, str] = dict(ref) if isinstance(ref, Mapping) else {None: ref}
    if not refs:
        raise ConfigError("the mapping is empty; name at least one environment factory", key)
    for name, r in refs.items():
        k = key if name is None else f"{key}.{name}"
        factory = _import(r, base_dir, k)
        try:
            instance = factory()
        except Exception as e:  # noqa: BLE001 — the user's factory, called once to probe it
            raise ConfigError(f"{r}() failed: {type(e).__name__}: {e} (the factory is called with no arguments, "
                              "once per rollout)", k) from None
        yield name, k, factory, instance


def load_environments(ref: str | Mapping[str, str], base_dir: str | None = None,
                      key: str = "rollout.environment") -> Environments:
    factories, tools, pool, rewards, classes = {}, {}, {}, [], []
    for name, k, factory, instance in _probe(ref, base_dir, key):
        if not callable(getattr(instance, "reset", None)):
            raise ConfigError(f"{type(instance).__name__} has no reset(): an environment starts each rollout with "
                              "reset(**row) and returns None or text to add to the last user message", k)
        methods = tool_methods(instance)
        for m in methods:
            schema(m, k)
        factories[name], tools[name], pool[name] = factory, [m.__name__ for m in methods], [instance]
        if callable(getattr(type(instance), "get_reward", None)) and type(instance) not in classes:
            classes.append(type(instance))
            rewards.append((type(instance).__name__, _reward_of(type(instance))))
    return Environments(factories, tools, rewards, pool)


def load_interaction(ref: str | Mapping[str, str], base_dir: str | None = None,
                     key: str = "rollout.interaction") -> Environments:
    """A gym-style environment factory (rlkit's, beyond TRL: games, dialogue, user simulators):
    each rollout gets an instance; ``reset(**row)`` starts it (None or text for the user turn),
    ``step(assistant_message) -> (observation | None, reward | None, done)`` answers each turn of
    the model; an observation is the next user turn, the rewards of a rollout add up to the
    reward source named after the class. No tools: its methods are not shown to the model."""
    factories, pool, rewards, classes = {}, {}, [], []
    for name, k, factory, instance in _probe(ref, base_dir, key):
        for method in ("reset", "step"):
            if not callable(getattr(instance, method, None)):
                raise ConfigError(f"{type(instance).__name__} has no {method}(): an interaction starts each rollout "
                                  "with reset(**row) and answers each turn with step(message) -> (observation, "
                                  "reward, done)", k)
        factories[name], pool[name] = factory, [instance]
        if type(instance) not in classes:
            classes.append(type(instance))
            rewards.append((type(instance).__name__, _step_rewards(type(instance))))
    return Environments(factories, {n: [] for n in factories}, rewards, pool, gym=True)


def _step_rewards(cls: type) -> Callable[..., list[float | None]]:
    """An interaction class's reward: the sum of its steps' rewards in each of its rollouts (None
    when no step gave one, and for rollouts of another class)."""
    def step_rewards(env_rewards: Sequence[float | None], environments: Sequence[Any],
                     **kwargs: Any) -> list[float | None]:
        return [r if type(e) is cls else None for r, e in zip(env_rewards, environments)]
    step_rewards.__name__ = step_rewards.__qualname__ = cls.__name__
    return step_rewards


def environment_rewards(environments: Environments) -> list[Any]:
    """The environments' `get_reward` as reward sources of the scorer (weight 1, named after the
    class, given ``environments=``), as TRL adds them beside the reward functions."""
    from rlkit.reward.resolve import ResolvedReward

    key, accepts = ("rollout.interaction", {"env_rewards", "environments"}) if environments.gym else (
        "rollout.environment", {"environments"})
    return [ResolvedReward(RewardSpec(fn=f"{key}:{name}", name=name), key, name, fn, False, frozenset(accepts),
                           False) for name, fn in environments.rewards]


# ---------------------------------------------------------------------------------- calling


@dataclass
class ToolResults:
    messages: list[dict[str, Any]]  # {"role": "tool", "name": ..., "content": ...} in call order
    calls: int = 0
    failures: int = 0
    seconds: float = 0.0


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop on a daemon thread for every async tool (and an async get_reward)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="rlkit-tools", daemon=True).start()
        return _LOOP


_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rlkit-tool")


def tool_dict(tools: Sequence[Callable]) -> dict[str, Callable]:
    return {t.__name__: t for t in tools}


def call_tools(tool_calls: Sequence[Mapping[str, Any]], tools: Mapping[str, Callable],
               timeout_s: float | None = None) -> ToolResults:
    """Run one assistant turn's tool calls (transformers' parsed form: ``{"type": "function",
    "function": {"name", "arguments"}}``) and return the tool messages, in call order. Sync tools
    run one after another (an environment's state sees them in order), async ones together."""
    start = time.perf_counter()
    out = ToolResults(messages=[])
    started = [_start_call(call, tools, timeout_s) for call in tool_calls]
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    for name, result in started:
        if isinstance(result, _Pending):
            result = result.wait(name, deadline, timeout_s)
        out.calls += 1
        if isinstance(result, _Failed):  # TRL's rule: the error goes to the model as the result
            out.failures += 1
            result = {"error": result.message}
        content = result if isinstance(result, list) else str(result)  # a list: content blocks, as TRL
        out.messages.append({"role": "tool", "name": name, "content": content})
    out.seconds = time.perf_counter() - start
    return out


@dataclass
class _Failed:
    message: str


@dataclass
class _Pending:
    """An async tool's call, running on the tools' event loop."""

    future: Any

    def wait(self, name: str, deadline: float | None, timeout_s: float | None) -> Any:
        try:
            return self.future.result(timeout=None if deadline is None else max(0.0, deadline - time.perf_counter()))
        except (FutureTimeout, TimeoutError):
            self.future.cancel()
            return _Failed(f"Tool {name} timed out after {timeout_s:g} s.")
        except Exception as e:  # noqa: BLE001
            return _Failed(str(e))


def _start_call(call: Mapping[str, Any], tools: Mapping[str, Callable],
                timeout_s: float | None) -> tuple[str, Any]:
    """(name, what it returned | `_Failed` | `_Pending` for an async tool): a sync tool runs now."""
    if call.get("type", "function") != "function":
        return call.get("name", "unknown"), _Failed(f"Unsupported tool call type: {call['type']}")
    function = call["function"]
    name, arguments = function["name"], function.get("arguments") or {}
    fn = tools.get(name)
    if fn is None:
        return name, _Failed(f"Tool {name} not found.")
    try:
        if inspect.iscoroutinefunction(fn):
            return name, _Pending(asyncio.run_coroutine_threadsafe(fn(**arguments), _loop()))
        return name, _POOL.submit(fn, **arguments).result(timeout=timeout_s)
    except (FutureTimeout, TimeoutError):
        return name, _Failed(f"Tool {name} timed out after {timeout_s:g} s.")
    except Exception as e:  # noqa: BLE001 — TRL's rule: the error goes to the model as the result
        return name, _Failed(str(e))
