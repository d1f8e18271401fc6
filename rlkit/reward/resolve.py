"""Resolve a RewardSpec to a checked callable: import by path, bind args, check columns."""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from rlkit.reward.contract import (
    FIXED_PARAMS,
    RewardError,
    RewardSpec,
    check_range,
    declared_range,
    did_you_mean,
    with_defaults,
)


@dataclass
class ResolvedReward:
    """A spec whose callable was imported and checked against the contract."""

    spec: RewardSpec
    key: str                    # recipe key, e.g. "rewards[1]"
    name: str
    fn: Callable[..., Any]      # the function, or the instance for a class
    is_instance: bool           # fn is a class instance: spec.args went to its constructor
    accepts: frozenset[str]     # keyword names the callable takes
    var_kw: bool                # has **kwargs
    setup: Callable[[], Any] | None = None
    bounds: tuple[float | None, float | None] | None = None  # the values it may return (range)
    batch_seconds: Callable[[int], float] | None = None  # what a batch of n may take, where it declares it
    _ready: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def ensure_setup(self) -> None:
        """Run the instance's ``setup()`` once (thread-safe; an ``async def setup`` is awaited)."""
        with self._lock:
            if not self._ready and self.setup is not None:
                out = self.setup()
                if inspect.isawaitable(out):
                    asyncio.run(_await(out))
            self._ready = True

    def call_kwargs(self, prompts: list, completions: list, completion_ids: list | None,
                    columns: dict[str, list]) -> dict[str, Any]:
        """The keyword arguments one call gets: the fixed three, columns, then args."""
        full = {k: v for k, v in columns.items() if k not in FIXED_PARAMS or k == "prompt_texts"}
        if not self.is_instance:
            full.update(self.spec.args)
        full.update(prompts=prompts, completions=completions, completion_ids=completion_ids)
        return full if self.var_kw else {k: v for k, v in full.items() if k in self.accepts}

    def __call__(self, prompts: list, completions: list, completion_ids: list | None,
                 columns: dict[str, list]) -> Any:
        """One call under the contract; an ``async def`` is run to completion here, and what a
        generator (``yield``, ``async`` too) yields becomes the list."""
        self.ensure_setup()
        out = self.fn(**self.call_kwargs(prompts, completions, completion_ids, columns))
        if inspect.isasyncgen(out):
            out = asyncio.run(_collect(out))
        elif inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        return list(out) if isinstance(out, Iterator) else out


async def _await(aw: Any) -> Any:
    return await aw


async def _collect(agen: Any) -> list:
    return [v async for v in agen]


def _err(key: str, spec: RewardSpec, msg: str) -> RewardError:
    return RewardError(f"{key}.fn: {spec.fn!r} — {msg}")


def _load_module(key: str, spec: RewardSpec, mod: str, base_dir: str | None) -> ModuleType:
    if mod.endswith(".py") or "/" in mod or os.sep in mod:
        path = mod if os.path.isabs(mod) else os.path.join(base_dir or os.getcwd(), mod)
        return _load_file(key, spec, os.path.abspath(path))
    extra = [os.path.abspath(d) for d in (base_dir, os.getcwd()) if d]
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
            raise _err(key, spec, f"importing {mod!r} failed: {e}") from None
        on_path = {os.path.abspath(p or os.curdir) for p in sys.path}
        top = mod.split(".")[0]
        has = lambda d: os.path.isfile(os.path.join(d, top + ".py")) or os.path.isdir(os.path.join(d, top))
        for d in extra:  # `my_rewards:fn` next to the recipe or in the working directory
            if d not in on_path and has(d):
                sys.path.insert(0, d)
                return _load_module(key, spec, mod, None)
        looked = ", ".join(["the Python path", *extra])
        raise _err(key, spec, f"no module {mod!r} (looked in {looked}); "
                              "write 'package.module:function' or 'path/to/file.py:function'") from None
    except RewardError:
        raise
    except Exception as e:
        raise _err(key, spec, f"importing {mod!r} failed: {type(e).__name__}: {e}{_where(e)}") from None


def _load_file(key: str, spec: RewardSpec, path: str) -> ModuleType:
    """`path/to/file.py:fn`: the file imported once under a name of its own (its path's hash)."""
    if not os.path.isfile(path):
        raise _err(key, spec, f"file {path} not found (paths are relative to the recipe's folder)")
    modname = f"_rlkit_reward_{zlib.crc32(path.encode()):08x}_{os.path.splitext(os.path.basename(path))[0]}"
    if modname in sys.modules:
        return sys.modules[modname]
    ispec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(ispec)
    sys.modules[modname] = module
    try:
        ispec.loader.exec_module(module)
    except Exception as e:  # the user's module failed at import
        del sys.modules[modname]
        raise _err(key, spec, f"importing {path} failed: {type(e).__name__}: {e}{_where(e, path)}") from None
    return module


def _where(e: BaseException, path: str | None = None) -> str:
    tb = e.__traceback__
    last = None
    while tb is not None:
        if path is None or tb.tb_frame.f_code.co_filename == path:
            last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    return f" ({os.path.basename(last.tb_frame.f_code.co_filename)}, line {last.tb_lineno})"


def resolve(spec: RewardSpec, base_dir: str | None = None, columns: set[str] | None = None,
            *, key: str = "rewards[0]") -> ResolvedReward:
    """Import ``spec.fn`` and check it against the contract, before any run.

    Checks: importable, attribute exists, callable, ``args`` bind to the signature, and
    every parameter without a default (other than prompts/completions/completion_ids) is a
    dataset column (skipped when ``columns`` is None) or an arg. What ``fn`` may name: a
    function (``async def`` and generators too), a ``functools.partial``, a static, class or
    bound method (``module:Class.method``, ``module:instance.method``), a callable instance,
    or a class (or a partial of one) with ``__call__``: a class is instantiated with
    ``args``; an instance's ``setup()``, if any, is deferred to the first call. Raises
    RewardError (one line, prefixed with ``key``).
    """
    obj, attr = find_object(spec, base_dir, key)
    factory = obj.func if isinstance(obj, functools.partial) else obj
    is_instance = inspect.isclass(factory)
    if is_instance:
        call, fn_args = _instantiate(obj, attr, spec.args, key), {}
        if not callable(call):
            raise _err(key, spec, f"class {attr} has no __call__; give it `def __call__(self, prompts, completions, "
                                  "**kwargs)` returning one float per completion (its constructor takes `args`; "
                                  "an optional `setup()` runs once before the first call)")
    else:
        call, fn_args = obj, spec.args  # `find_object` checked it is callable
    setup = _setup(call, attr, spec, key)
    named, var_kw = _check_signature(call, attr, fn_args, columns, spec, key)
    name = spec.name or _default_name(obj, attr)
    try:
        bounds = (check_range(spec.range, f"{key}.range") if spec.range is not None
                  else declared_range(call, fn_args))
    except RewardError:
        raise
    except Exception as e:  # a range function of the user's own that failed
        raise RewardError(f"{key}: the reward_range of {attr} failed: {type(e).__name__}: {e}") from None
    preflight = getattr(obj, "rlkit_preflight", None)
    if callable(preflight):  # e.g. a code reward: its sandbox can run here
        preflight(spec.args, key)
    return ResolvedReward(spec=spec, key=key, name=name, fn=call, is_instance=is_instance,
                          accepts=frozenset(named), var_kw=var_kw, setup=setup, bounds=bounds,
                          batch_seconds=_batch_time(call, spec.args))


def _batch_time(call: Any, args: dict[str, Any]) -> Callable[[int], float] | None:
    """The reward's declared time for a batch of n (`contract.batch_seconds`), its arguments bound once."""
    fn = source_object(call)
    derive = getattr(fn, "rlkit_batch_seconds", None)
    if not callable(derive):
        return None
    bound = with_defaults(fn, dict(args))
    return lambda n: float(derive(n, bound))


def _setup(call: Any, attr: str, spec: RewardSpec, key: str) -> Callable[[], Any] | None:
    """A callable instance's ``setup()`` (None for functions and methods), checked to take no arguments."""
    if not is_object(call):
        return None
    setup = getattr(call, "setup", None)
    if not callable(setup):
        return None
    try:
        sig = inspect.signature(setup)
    except ValueError:  # no signature to read (a builtin): trust it
        return setup
    try:
        sig.bind()
    except TypeError:
        raise _err(key, spec, f"{attr}.setup{sig} takes arguments, but setup() is called with none; pass what it "
                              "needs through `args` (to the constructor)") from None
    return setup


def _default_name(obj: Any, attr: str) -> str:
    """The metric name: the function's or class's own name, else (lambdas, partials, instances) the
    last part of the name the recipe wrote."""
    name = getattr(obj, "__name__", None)
    if isinstance(name, str) and name.isidentifier():
        return name
    return attr.rpartition(".")[2]


def find_object(spec: RewardSpec, base_dir: str | None, key: str) -> tuple[Any, str]:
    """The callable `spec.fn` names, and its attribute path (``Class.method`` after a colon)."""
    ref = spec.fn.strip()
    if ":" in ref:
        mod, _, attr = ref.rpartition(":")
    elif "." in ref:
        mod, _, attr = ref.rpartition(".")
    else:
        raise _err(key, spec, "expected 'module:function' or 'path/to/file.py:function'")
    parts = attr.split(".")
    if not mod or not all(p.isidentifier() for p in parts):
        raise _err(key, spec, "expected 'module:function' or 'path/to/file.py:function'")
    module = _load_module(key, spec, mod, base_dir)
    obj, owner = module, None
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            where = f"module {mod!r}" if i == 0 else repr(".".join(parts[:i]))
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            raise _err(key, spec, f"{where} has no function {part!r}{did_you_mean(part, names)}")
        owner, obj = obj, getattr(obj, part)
    if inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, parts[-1], None)):
        cls = ".".join(parts[:-1])
        raise _err(key, spec, f"{attr} is a method of class {cls}, which needs an instance; give {cls} a "
                              f"`__call__` and name the class ({mod}:{cls}), make {parts[-1]} a @staticmethod, "
                              f"or name a method of a module-level instance")
    if not callable(obj):
        raise _err(key, spec, f"{attr!r} is a {type(obj).__name__}, not a function, class or callable object; "
                              f"write `def {parts[-1]}(prompts, completions, **kwargs)` returning one float per "
                              "completion")
    return obj, attr


def _instantiate(cls: Any, attr: str, args: dict[str, Any], key: str) -> Any:
    """A reward class (or a partial of one) built with the recipe's `args` (its `setup()` runs on first call)."""
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise RewardError(f"{key}.args: {attr}({_fmt_args(args)}) — {e}") from None
    try:
        return cls(**args)
    except Exception as e:
        raise RewardError(f"{key}.args: constructing {attr} failed: {type(e).__name__}: {e}") from None


def _check_signature(target: Callable[..., Any], attr: str, fn_args: dict[str, Any], columns: set[str] | None,
                     spec: RewardSpec, key: str) -> tuple[dict[str, inspect.Parameter], bool]:
    """Check the call contract; returns the keyword parameters and whether it takes **kwargs."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        raise _err(key, spec, f"cannot read the signature of {attr!r}") from None
    params = sig.parameters.values()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    posonly = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if posonly:
        raise _err(key, spec, f"parameters {posonly} are positional-only; rewards are called with keywords")
    if "completions" not in named and not var_kw:
        raise _err(key, spec, f"{attr}{sig} does not take `completions`; "
                              "the contract is fn(prompts, completions, completion_ids=None, **kwargs)")
    if not var_kw:
        for a in fn_args:
            if a not in named:
                raise RewardError(f"{key}.args: {a!r} is not a parameter of {attr}{did_you_mean(a, list(named))}; "
                                  f"it takes {', '.join(named) or 'nothing'}")
    clash = sorted(set(fn_args) & (columns or set()))
    if clash:
        raise RewardError(f"{key}.args: {clash[0]!r} is also a dataset column; rename the arg")
    available = set(FIXED_PARAMS) | set(fn_args) | (columns if columns is not None else set(named))
    missing = [n for n, p in named.items() if p.default is p.empty and n not in available]
    one_of = getattr(target, "rlkit_needs_one_of", None)
    if missing or (one_of and columns is not None and not set(one_of) & available):
        have = ", ".join(sorted(columns or ())) or "none"
        need = ", ".join(repr(m) for m in missing) if missing else "one of " + ", ".join(map(repr, one_of))
        raise RewardError(f"{key}: {attr} needs {need} — not a dataset column (columns: {have}) nor in args")
    return named, var_kw


def is_object(fn: Any) -> bool:
    """Whether a resolved reward is an instance (built from a class, or a module-level callable
    object) rather than a function, method or partial."""
    return not (inspect.isroutine(fn) or isinstance(fn, functools.partial))


def source_object(fn: Any) -> Any:
    """Where a reward's code lives: a function's own, a partial's or method's function, an instance's class."""
    while isinstance(fn, functools.partial) or inspect.ismethod(fn):
        fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
    return inspect.unwrap(fn) if inspect.isroutine(fn) else type(fn)


def _fmt_args(args: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def describe_rewards(specs: tuple[RewardSpec, ...] | list[RewardSpec], base_dir: str | None) -> list[str]:
    """One line per reward, each resolved as a run resolves it: its metric name, the file and
    line it comes from, its weight and the keyword arguments it takes (`--print-config`)."""
    lines = []
    for i, spec in enumerate(specs):
        r = resolve(spec, base_dir, key=f"rewards[{i}]")
        target = source_object(r.fn)
        try:
            where = f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
        except (TypeError, OSError):
            where = getattr(target, "__module__", "?")
        takes = ", ".join(sorted(r.accepts)) + (", **kwargs" if r.var_kw else "")
        lines.append(f"rewards[{i}] {r.name}: {spec.fn} -> {where} (weight {spec.weight:g}; takes {takes})")
    return lines
