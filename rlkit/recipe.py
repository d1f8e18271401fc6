"""Load YAML recipes into frozen dataclasses: typed, unknown keys rejected, overrides applied.

Every user mistake becomes a `ConfigError` whose one-line message names the file and the key,
e.g. `recipes/x.yaml: train.micro_batch_sz: unknown key (did you mean 'micro_batch_size'?)`.
A dataclass rejects a value in `__post_init__` with `check(cond, key, message)`, or by raising
any `UserError` that carries a `key`; the key is relative to that dataclass.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from rlkit.errors import ConfigError, UserError

T = TypeVar("T")


def _invalid(key: str, message: str) -> ConfigError:
    """The error for a bad value at `key` (relative to the dataclass being built)."""
    return ConfigError(message, key=key)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["train.lr=1e-4", "lora.r=8"]` -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is set twice as value and section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def merge(base: dict, extra: dict) -> dict:
    """Deep-merge `extra` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: recipe file not found")
    try:
        text = p.read_text(encoding="utf-8")
        _no_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), "", path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def _no_duplicate_keys(node: Any, key: str, path: str | Path) -> None:
    """A ConfigError for a key given twice in one mapping (YAML would keep the last silently)."""
    if isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
            full = f"{key}.{name}" if key else name
            if name in lines:
                raise ConfigError(f"{path}: {full} is given twice (lines {lines[name]} and {k.start_mark.line + 1}); "
                                  "the second would silently win: keep one")
            lines[name] = k.start_mark.line + 1
            _no_duplicate_keys(v, full, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _no_duplicate_keys(v, f"{key}[{i}]", path)


def build(cls: type[T], data: Any, source: str, key: str = "") -> T:
    """Convert plain YAML data to `cls`, checking keys and types; errors name `source` and key."""
    try:
        return _convert(cls, data, key)
    except UserError as e:
        if e.key is None:
            raise
        raise ConfigError(f"{source}: {e.key or '<top>'}: {e.message}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain data (for printing and saving the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _join(key: str, sub: str | int) -> str:
    if isinstance(sub, int):
        return f"{key}[{sub}]"
    return f"{key}.{sub}" if key else sub


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, key)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, key)
    if origin is Literal:
        bool_for_non_bool = isinstance(value, bool) and not any(isinstance(a, bool) for a in get_args(tp))
        if value in get_args(tp) and not bool_for_non_bool:
            return value
        raise _invalid(key, f"expected one of {_type_name(tp)}, got {value!r}")
    if origin in (list, tuple):
        return _convert_sequence(tp, value, key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _invalid(key, f"expected a mapping, got {_describe(value)}")
        return dict(value)
    if tp in (bool, int, float, str):
        return _convert_scalar(tp, value, key)
    raise TypeError(f"recipe type {tp!r} at {key} is not supported")  # a bug in rlkit's schema


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    candidates = [a for a in args if a is not type(None)]
    if len(candidates) == 1:  # Optional[X]: X's own, more precise error
        return _convert(candidates[0], value, key)
    for arg in candidates:
        try:
            return _convert(arg, value, key)
        except ConfigError:
            continue
    raise _invalid(key, f"expected {_type_name(tp)}, got {_describe(value)}")


def _convert_sequence(tp: Any, value: Any, key: str) -> tuple:
    args = get_args(tp)
    if not isinstance(value, (list, tuple)):
        if isinstance(value, str) and args and args[0] is str:
            value = [v.strip() for v in value.split(",") if v.strip()]  # "q_proj,v_proj"
        else:
            raise _invalid(key, f"expected a list, got {_describe(value)}")
    if get_origin(tp) is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise _invalid(key, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, _join(key, i)) for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else Any
    return tuple(_convert(item, v, _join(key, i)) for i, v in enumerate(value))


def _convert_scalar(tp: type, value: Any, key: str) -> Any:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and is_number and (isinstance(value, int) or value.is_integer()):
        return int(value)
    if tp is float and is_number:
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, str):
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
    raise _invalid(key, f"expected {expected}, got {_describe(value)}")


def _convert_dataclass(cls: Any, value: Any, key: str) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _invalid(key, f"expected a mapping, got {_describe(value)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = next((name for name in value if name not in fields), None)
    if unknown is not None:
        raise _unknown_key(cls, str(unknown), key, list(fields))
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            given = value[name]
            if dataclasses.is_dataclass(hints[name]) and f.default_factory is not dataclasses.MISSING \
                    and (given is None or isinstance(given, dict)):
                # a section this stage gives its own defaults (GRPO's optim): a key set changes that key only
                given = merge(to_dict(f.default_factory()), given or {})
            kwargs[name] = _convert(hints[name], given, _join(key, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _invalid(_join(key, name), f"required key is missing (expected {_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except UserError as e:
        if e.key is None:
            raise
        raise _invalid(_join(key, e.key), e.message) from None


def _unknown_key(cls: Any, name: str, key: str, fields: list[str]) -> ConfigError:
    """The error for a key `cls` has not: renamed, read by another stage, or the nearest keys."""
    renamed = getattr(cls, "RENAMED", {}).get(name)
    if renamed:
        return _invalid(_join(key, name), f"renamed: use {renamed!r}")
    elsewhere = getattr(cls, "READ_ELSEWHERE", {}).get(name)
    if elsewhere:
        return _invalid(_join(key, name), f"this stage does not read it ({elsewhere}); remove it")
    near = nearest_keys(cls, name)
    hint = f" (did you mean {' or '.join(repr(k) for k in near)}?)" if near else f" (valid keys: {', '.join(fields)})"
    return _invalid(_join(key, name), f"unknown key{hint}")


def nearest_keys(cls: Any, name: str) -> list[str]:
    """The keys of `cls` a mistyped or section-less `name` most likely means: its name in a peer
    toolkit (`PEER_NAMES`), the same name inside a section (`lr` -> `optim.lr`), a close top-level
    key, a close key inside a section; [] when nothing is close."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    inside = {k: k.rpartition(".")[2] for k in section_keys(cls)}
    peer = getattr(cls, "PEER_NAMES", {}).get(name)
    if peer or name in fields:
        return [peer or name]
    close = difflib.get_close_matches(name, set(inside.values()), n=1, cutoff=0.7)
    return ([k for k, last in inside.items() if last == name]
            or difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            or [k for k, last in inside.items() if last in close])


def section_keys(cls: Any) -> list[str]:
    """The dotted keys inside `cls`'s sections (`optim.lr`, `train.max_steps`, ...), for a key
    given without its section."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [t for t in (get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(t)]
        for sub in inner[:1]:
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub) if g.init]
            keys += [f"{f.name}.{k}" for k in section_keys(sub)]
    return keys


def replaced(obj: Any, key: str, value: Any) -> Any:
    """A copy of frozen dataclass `obj` with the field at the dotted `key` set to `value`."""
    head, _, rest = key.partition(".")
    return dataclasses.replace(obj, **{head: replaced(getattr(obj, head), rest, value) if rest else value})


def changed(obj: Any, values: Mapping[str, Any]) -> Any:
    """A copy of frozen dataclass `obj` with the fields at these dotted keys set; the keys of one
    section go in together, so its own rules (`__post_init__`) see them at once."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        sections.setdefault(section, {})[name] = value
    for section, fields in sections.items():
        if not section:  # keys of `obj` itself
            obj = dataclasses.replace(obj, **fields)
            continue
        inner = functools.reduce(getattr, section.split("."), obj)
        obj = replaced(obj, section, dataclasses.replace(inner, **fields))
    return obj


def check(cond: bool, key: str, message: str) -> None:
    """Cross-field rule helper for `__post_init__`: raise the error for `key` unless `cond`."""
    if not cond:
        raise _invalid(key, message)

