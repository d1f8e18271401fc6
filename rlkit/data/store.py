"""What the driver holds of a dataset, compactly: rows as the file had them (`PackedRows`: each
row pickled into one buffer, about the file's own size instead of 4x it as Python dicts), and
tokenised SFT samples (`TokenRows`: 5 bytes a token instead of Python lists).

A sample's ``input_ids`` go into one flat int32 array and which of them are targets into a byte
array (a label is the token itself or -100: ``encode_sft``'s rule); samples are cut out by
offsets when a batch is made. A list of Python ints costs about 36 bytes a token (a pointer and
an int object) for the ids and as much again for the labels: SFT on 1M rows (a 0.9 GiB JSONL
file) held 12.2 GiB before the first step, and holds 2.5 GiB here (`scripts/bench_data.py`).
Anything else a sample carries (its images), or labels outside that rule, is kept as given, for
that sample only.
"""

from __future__ import annotations

import operator
import pickle
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

IGNORE_INDEX = -100


class _Cut(Sequence[dict[str, Any]]):
    """Items cut out of flat storage at the offsets `_ends` (the first is 0); `_item(i)` makes one."""

    _ends: array
    _kind = "item"

    def _item(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._ends) - 1

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self._item(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self._kind} {i} of {n}")
        return self._item(i % n)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._item(k) for k in range(len(self)))


class PackedRows(_Cut):
    """Append-only rows, each pickled into one growing buffer; indexing unpickles a fresh copy (a
    change to it is not kept: copy the rows out with ``list()`` to edit them). Equal to a list of
    the same rows. A 0.9 GiB JSONL file of 1M rows held 4.4 GiB as dicts, and 0.94 GiB here."""

    _kind = "row"

    def __init__(self, rows: Iterable[dict[str, Any]] = ()) -> None:
        self._buf = bytearray()
        self._ends = array("q", [0])
        for r in rows:
            self.append(r)

    def append(self, row: dict[str, Any]) -> None:
        self._buf += pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL)
        self._ends.append(len(self._buf))

    def _item(self, i: int) -> dict[str, Any]:
        return pickle.loads(self._buf[self._ends[i]:self._ends[i + 1]])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PackedRows, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [*self, *other]

    def __radd__(self, other: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"PackedRows({len(self)} rows, {len(self._buf)} bytes)"

    def nbytes(self) -> int:
        return len(self._buf) + self._ends.itemsize * len(self._ends)


class TokenRows(_Cut):
    """Append-only samples ``{"input_ids": [...], "labels": [...], ...}``; indexing gives them back
    as lists (a slice gives a list of samples)."""

    def __init__(self, samples: Iterable[dict[str, Any]] = ()) -> None:
        self._ids = array("i")
        self._target = array("b")
        self._ends = array("q", [0])
        self._extra: dict[int, dict[str, Any]] = {}
        for s in samples:
            self.append(s)

    def append(self, sample: dict[str, Any]) -> None:
        ids, labels = sample["input_ids"], sample["labels"]
        if len(ids) != len(labels):
            raise ValueError(f"a sample has {len(ids)} input_ids and {len(labels)} labels")
        extra = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
        target = bytes(map(operator.eq, ids, labels))  # ids are >= 0: a position is a target or -100, or neither
        if sum(target) + labels.count(IGNORE_INDEX) != len(labels):
            extra["labels"] = list(labels)  # labels of its own: kept as they are
        if extra:
            self._extra[len(self)] = extra
        self._ids.extend(ids)
        self._target.frombytes(target)
        self._ends.append(len(self._ids))

    _kind = "sample"

    def _item(self, i: int) -> dict[str, Any]:
        start, end = self._ends[i], self._ends[i + 1]
        ids = self._ids[start:end].tolist()
        out = {"input_ids": ids,
               "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, self._target[start:end])]}
        out.update(self._extra.get(i, {}))
        return out

    def lengths(self) -> Sequence[int]:
        """Each sample's token count."""
        return [self._ends[k + 1] - self._ends[k] for k in range(len(self))]

    def nbytes(self) -> int:
        """Bytes the token arrays take (the samples' extras not counted)."""
        return (self._ids.itemsize * len(self._ids) + len(self._target)
                + self._ends.itemsize * len(self._ends))
