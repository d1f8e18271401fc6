"""The files rows come in: JSON and JSONL (gzip, bz2 or xz compressed too), parquet, CSV and TSV,
Arrow IPC files and streams (feather v2, `datasets`' cache files); a glob or a folder of shards.

Each file yields ``(row number, row)`` lazily, a record batch at a time for the columnar ones
(never the whole table as Python objects at once); the columnar ones also give their column
names, so a missing column is one line naming the file before any row is read. Row numbers are
what a user finds the row by: a JSONL file's line number, else the 1-based position (a CSV's
header is not a row); in a set of shards, ``"<n> of <shard>"``. CSV cells are read as text, as
written (Arrow would type a column of digits as integers).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rlkit.errors import DataError, parse_json

Record = tuple[int | str, Any]  # (row number as the user counts it, parsed row)

_COMPRESSED: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_KINDS = {".json": "JSON", ".jsonl": "JSONL", ".parquet": "parquet", ".pq": "parquet", ".csv": "CSV",
          ".tsv": "TSV", ".arrow": "Arrow", ".feather": "Arrow", ".ipc": "Arrow"}
SUPPORTED = ".json, .jsonl (either .gz, .bz2 or .xz too), .parquet, .csv, .tsv, .arrow or .feather"
_SPLIT = re.compile(r"^(train|test|validation|valid|dev|eval)(?=$|[-_.])")
_BATCH = 4096  # rows converted to Python at a time


@dataclass(frozen=True)
class DataFile:
    """One file's rows: ``rows`` is lazy; ``columns`` is None where rows carry their own keys (JSON)."""

    path: str
    kind: str
    rows: Iterator[Record]
    columns: tuple[str, ...] | None


def kind_of(path: str) -> str | None:
    """The container a file name says (``JSONL``, ``parquet``, ...), or None."""
    base, ext = os.path.splitext(path.lower())
    if ext in _COMPRESSED:
        base, ext = os.path.splitext(base)
        return _KINDS[ext] if ext in (".json", ".jsonl", ".csv", ".tsv") else None
    return _KINDS.get(ext)


def open_file(path: str) -> DataFile:
    """Open one file of rows (its kind from its name; ``kind_of`` must know it)."""
    kind = kind_of(path)
    if kind in ("JSON", "JSONL"):
        return DataFile(path, kind, _json_rows(path, kind), None)
    try:
        import pyarrow as pa  # lazy: heavy import

        if kind == "parquet":
            import pyarrow.parquet as pq

            f = pq.ParquetFile(path)
            return DataFile(path, kind, _guarded(path, kind, f.iter_batches(batch_size=_BATCH)),
                            tuple(f.schema_arrow.names))
        if kind == "Arrow":
            source = pa.memory_map(path)
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # an IPC stream (what `datasets` writes to its cache)
                reader = batches = pa.ipc.open_stream(pa.memory_map(path))
            return DataFile(path, kind, _guarded(path, kind, batches), tuple(reader.schema.names))
        return _csv(path, kind)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as {_a(kind)} file ({_one_line(e)})") from None


def _csv(path: str, kind: str) -> DataFile:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    parse = pcsv.ParseOptions(delimiter="\t" if kind == "TSV" else ",")
    names = tuple(pcsv.open_csv(path, parse_options=parse).schema.names)
    text = pcsv.ConvertOptions(column_types={n: pa.string() for n in names})
    reader = pcsv.open_csv(path, parse_options=parse, convert_options=text,
                           read_options=pcsv.ReadOptions(block_size=1 << 22))
    return DataFile(path, kind, _guarded(path, kind, reader), names)


def _guarded(path: str, kind: str, batches: Any) -> Iterator[Record]:
    """The rows of record batches, numbered from 1; a read error later in the file is one line too."""
    import pyarrow as pa

    n = 0
    try:
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as {_a(kind)} file after row {n} ({_one_line(e)})") from None


def _a(kind: str) -> str:
    return ("an " if kind == "Arrow" else "a ") + kind


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _json_rows(path: str, kind: str) -> Iterator[Record]:
    """Yield (row number, parsed row). JSONL is read a line at a time and numbered by its lines; a
    JSON file is parsed whole (a list of rows), or as JSONL when it starts with '{'."""
    opener = _COMPRESSED.get(os.path.splitext(path.lower())[1], open)
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if kind == "JSON":
                text = f.read()
                if not text.lstrip().startswith("{"):
                    yield from enumerate(parse_json(text, path, list, "a JSON list of rows", DataError), start=1)
                    return
                lines: Iterable[str] = text.split("\n")  # not splitlines: U+2028 may sit in a string
            else:
                lines = f
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    if lineno == 1 and kind == "JSON":  # a single pretty-printed object
                        raise DataError(f"{path}: expected a JSON list of rows or JSON lines") from None
                    raise DataError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
        where = f" after line {lineno}" if lineno else ""
        raise DataError(f"{path}: cannot read file{where} ({_one_line(e)})") from None


def shard_files(path: str, split: str | None) -> list[str] | None:
    """The files a glob or a folder of shards names (sorted), or None when ``path`` is neither.

    A folder's files are found at any depth; where their names (or their first folder) start
    with a split name (``train-00000-of-00002.parquet``, ``test/0.parquet``: the hub's layout),
    ``split`` picks one, by default ``train`` or the only split there."""
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"{path}: no file matches")
        odd = next((p for p in files if kind_of(p) is None), None)
        if odd:
            raise DataError(f"{path}: matches {odd}, which is not a file of rows (expected {SUPPORTED})")
        return files
    if not os.path.isdir(path):
        return None
    files = sorted(p for p in glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
                   if os.path.isfile(p) and kind_of(p) and not os.path.basename(p).startswith("."))
    if not files:
        return None
    kinds = sorted({kind_of(p) for p in files})
    if len(kinds) > 1:
        raise DataError(f"{path}: holds {' and '.join(kinds)} files; name the ones to read with a glob "
                        f"({os.path.join(path, '*.' + os.path.basename(files[-1]).partition('.')[2])}, say)")
    splits = {p: _split_of(os.path.relpath(p, path)) for p in files}
    found = sorted({s for s in splits.values() if s})
    if not found:
        if split not in (None, "train"):
            raise DataError(f"{path}: no file is named for split {split!r} (its files name no split)")
        return files
    want = split or ("train" if "train" in found or len(found) > 1 else found[0])
    if want not in found:
        raise DataError(f"{path}: split {want!r} not found (its files have {', '.join(found)}); set split")
    return [p for p in files if splits[p] == want]


def _split_of(rel: str) -> str | None:
    m = _SPLIT.match(rel.split(os.sep)[0]) or _SPLIT.match(os.path.basename(rel))
    return m.group(1) if m else None


def read_shards(files: list[str]) -> tuple[Iterator[Record], dict[str, tuple[str, ...]]]:
    """The rows of several files in turn, numbered ``"<n> of <file>"``, and each columnar file's columns."""
    opened = [open_file(p) for p in files]
    columns = {f.path: f.columns for f in opened if f.columns is not None}
    if len(opened) == 1:
        return opened[0].rows, columns

    def rows() -> Iterator[Record]:
        for f in opened:
            name = os.path.basename(f.path)
            for n, row in f.rows:
                yield f"{n} of {name}", row
    return rows(), columns


def check_columns(columns: dict[str, tuple[str, ...]], needed: list[str], rows: str) -> None:
    """A table file without a column its rows need (``rows`` says which rows): one line naming both."""
    for path, have in columns.items():
        missing = next((c for c in needed if c not in have), None)
        if missing:
            raise DataError(f"{path}: has no column {missing!r}, which {rows} need (its columns: "
                            f"{', '.join(have) or 'none'}); rename the column, or map it with a "
                            "dataset_info.json entry's `columns`")
