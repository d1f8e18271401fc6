"""What a sandbox sends back: plain data (None, bool, int, float, str, bytes, and lists, tuples, sets,
frozensets and dicts of them, tagged in JSON), decoded by the judge in time linear in its bytes. A set
or dict is built only after a pass that refuses values made to share one hash (`hash_safe`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from rlkit.reward import sandbox

# Distinct values of one hash a set or dict may be built from: values the sandbox chose to hash
# alike (ints equal modulo 2**61 - 1) would make building it quadratic in the driver (40,000 such
# ints: 6.8 s); a real result has none or a few.
SAME_HASH = 8


def hash_safe(items: Any) -> list:
    """`items` as a list, or ValueError when more than SAME_HASH distinct ones share a hash: what a
    set, frozenset or dict may be built from in the judge (linear: a few comparisons per item)."""
    items, seen = list(items), {}
    for x in items:
        alike = seen.setdefault(hash(x), [])
        if not any(x == y for y in alike):
            if len(alike) == SAME_HASH:
                raise ValueError("values that hash alike")
            alike.append(x)
    return items


def plain_set(items: Any = ()) -> set:
    return set(hash_safe(items))


def plain_frozenset(items: Any = ()) -> frozenset:
    return frozenset(hash_safe(items))


TAGS: dict[str, Callable[[Any], Any]] = {"tuple": tuple, "set": plain_set, "frozenset": plain_frozenset}
# what plain data can raise in the judge: a failed test, never a failed step
BAD = (ValueError, TypeError, KeyError, ArithmeticError, RecursionError, MemoryError)


def decode(v: Any) -> Any:
    """A value the sandbox sent, back to Python (its tags undone); ValueError if not plain data."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [decode(x) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, x), = v.items()
        if tag in TAGS and type(x) is list:
            return TAGS[tag](decode(i) for i in x)
        if tag == "dict" and type(x) is list and all(type(p) is list and len(p) == 2 for p in x):
            pairs = [(decode(k), decode(val)) for k, val in x]
            hash_safe(k for k, _ in pairs)
            return dict(pairs)
        if tag == "bytes" and type(x) is str:
            return bytes.fromhex(x)
        if tag == "float" and x in ("nan", "inf", "-inf"):
            return float(x)
    raise ValueError("not plain data")


def records(out: bytes) -> dict[int, dict]:
    """The first well-formed record per index."""
    got: dict[int, dict] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(rec) is dict and type(rec.get("i")) is int:
            got.setdefault(rec["i"], rec)
    return got


def sent_values(out: sandbox.Outcome, exprs: list[str]) -> dict[str, Any]:
    """The plain values a run sent back for its expressions (those it could not send are missing)."""
    vals = {}
    for i, rec in records(out.stdout).items():
        if 0 <= i < len(exprs) and "v" in rec:
            with contextlib.suppress(*BAD):
                vals[exprs[i]] = decode(rec["v"])
    return vals
