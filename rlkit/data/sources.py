"""Read the records of a data source; what a row means is `formats.py`'s business.

Sources (detected from the path):

- a file of rows: ``.json`` (a list of rows) or ``.jsonl`` (one row per line), either
  compressed too (``.gz``, ``.bz2``, ``.xz``), ``.parquet``, ``.csv``/``.tsv``, ``.arrow`` or
  ``.feather`` (`containers.py` reads each); a glob of such files or a folder of them (shards;
  ``split`` picks the hub's ``train-*``/``test-*`` files);
- a LLaMA-Factory ``dataset_info.json`` (the file, or a folder holding it) plus a
  ``dataset`` name; its entry gives ``file_name``, ``formatting`` (alpaca | sharegpt |
  openai), ``columns`` (with ``kto_tag``: rows tagged false are dropped), ``tags`` and
  ``num_samples`` (as LLaMA-Factory: a seeded permutation of all rows cut to that many, or
  all rows plus random repeats when it asks for more) and ``ranking`` (preference pairs:
  `preference.py` reads those, SFT and GRPO say in one line that they take none). Video and
  audio columns are refused in one line;
- a folder written by ``datasets`` ``save_to_disk`` (a Dataset or a DatasetDict; ``split``
  picks one, default ``train`` or the only split).

JSON and JSONL are parsed with the standard library, not ``datasets.load_dataset``: Arrow
infers one type per column and would coerce or reject a bad row without saying which one,
while here every error names the file and the row (for JSONL, the line number; for a JSON
list, a table file or a saved dataset, the 1-based position; in shards, ``<n> of <file>``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlkit.data.containers import SUPPORTED, Record, kind_of, read_shards, shard_files
from rlkit.data.images import IMAGE_COLUMNS
from rlkit.errors import DataError, read_json

log = logging.getLogger("rlkit")


@dataclass(frozen=True)
class DatasetEntry:
    """What a dataset_info.json entry says about its rows (LLaMA-Factory's keys)."""

    where: str  # "<info file>: dataset '<name>'", for messages
    formatting: str  # "alpaca" | "sharegpt" | "openai"
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] | None = None
    num_samples: int | None = None
    ranking: bool = False  # chosen/rejected preference pairs (`rlkit dpo`, `rlkit rm`)


@dataclass(frozen=True)
class Records:
    """The records of a source, read as they are iterated (once); `entry` is set when they come
    through a dataset_info.json."""

    records: Iterable[Record]
    source: str
    entry: DatasetEntry | None = None
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)  # each table file's columns


MEDIA_COLUMNS = ("images", "videos", "audios")  # LLaMA-Factory's multimodal columns


def read_records(path: str, dataset: str | None = None, split: str | None = None, seed: int = 0) -> Records:
    """Read every record of `path` (any source above); `seed` draws `num_samples` rows."""
    path = os.fspath(path)
    is_info = os.path.basename(path) == "dataset_info.json" and os.path.isfile(path)
    if is_info or (os.path.isdir(path) and not _is_saved_dataset(path)
                   and os.path.isfile(os.path.join(path, "dataset_info.json"))):
        got = _read_dataset_info(path, dataset, split)
        if got.entry.num_samples is None:
            return got
        every = list(got.records)
        drawn = sample_records(every, got.entry.num_samples, seed)
        log.info("%s: %d rows drawn from %d (num_samples, seed %d)", got.source, len(drawn), len(every), seed)
        return Records(drawn, got.source, got.entry, got.columns)
    records, source, columns = _read_container(path, split)
    return Records(records, source, columns=columns)


class Peeked:
    """Records read as they are iterated, the first ones (up to the first object) read ahead:
    the format is told from the first row before the rest is read."""

    def __init__(self, records: Iterable[Record]) -> None:
        self._rest = iter(records)
        self.head: list[Record] = []
        for rec in self._rest:
            self.head.append(rec)
            if isinstance(rec[1], dict):
                break

    @property
    def first(self) -> dict | None:
        """The first row that is an object (None: there is none)."""
        return self.head[-1][1] if self.head and isinstance(self.head[-1][1], dict) else None

    def __iter__(self) -> Iterator[Record]:
        yield from self.head
        yield from self._rest


def drop_kto_false(records: Iterable[Record], col: str, source: str) -> Iterator[Record]:
    """LLaMA-Factory's KTO data tags each response desirable (true) or not (false): a false one
    must not become a target (nor a GRPO gold). A row without the tag is kept, as there."""
    kept = total = 0
    for n, rec in records:
        total += 1
        tag = rec.get(col) if isinstance(rec, dict) else None
        if tag is not None and not isinstance(tag, bool):
            raise DataError(f"{source}: row {n}: field {col!r} (kto_tag) is {type(tag).__name__} "
                            "(expected true or false)")
        if tag is not False:
            kept += 1
            yield n, rec
    if kept < total:
        log.warning("%s: dropped %d of %d rows tagged %s=false (KTO's undesirable responses are not "
                    "training targets)", source, total - kept, total, col)
    if not kept:
        raise DataError(f"{source}: every row is tagged {col}=false (KTO's undesirable responses); nothing to train on")


def sample_records(records: list[Record], n: int, seed: int) -> list[Record]:
    """LLaMA-Factory's `num_samples`: a seeded permutation cut to n rows; when n is more than
    there are, every row once plus n - len random repeats. Row numbers stay the file's."""
    import numpy as np

    rng = np.random.RandomState(seed)
    idx = list(rng.permutation(len(records))[:n])
    if n > len(records):
        idx += list(rng.choice(len(records), n - len(records)))
    return [records[i] for i in idx]


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))


def _read_saved_dataset(path: str, split: str | None) -> Iterator[tuple[int, Any]]:
    import datasets  # lazy: heavy import

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - any failure is a user-data problem here
        raise DataError(f"{path}: cannot load saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None:
            split = "train" if "train" in ds else (names[0] if len(names) == 1 else None)
        if split not in ds:
            raise DataError(f"{path}: split {split!r} not found (available: {', '.join(names)}); "
                            "set split")
        ds = ds[split]
    elif split not in (None, "train"):
        raise DataError(f"{path}: is a single Dataset, it has no split {split!r}")
    yield from enumerate(ds.to_list(), start=1)


def _read_dataset_info(path: str, dataset: str | None, split: str | None) -> Records:
    info_path = os.path.join(path, "dataset_info.json") if os.path.isdir(path) else path
    info = read_json(info_path, dict, "a JSON object of dataset entries", DataError)
    if dataset is None:
        raise DataError(f"{info_path}: name the dataset to use (available: {', '.join(info)})")
    if dataset not in info:
        raise DataError(f"{info_path}: dataset {dataset!r} not found "
                        f"(available: {', '.join(info) or 'none'})")
    entry = info[dataset]
    where = f"{info_path}: dataset {dataset!r}"
    if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str):
        raise DataError(f"{where}: needs a 'file_name' (only local files are supported)")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt", "openai"):
        raise DataError(f"{where}: formatting {formatting!r} not supported "
                        "(expected alpaca, sharegpt or openai)")
    columns = dict(entry.get("columns") or {})
    media = [k for k in MEDIA_COLUMNS if k in columns and k not in IMAGE_COLUMNS]
    if media:
        raise DataError(f"{where}: has {media[0]} (column {columns[media[0]]!r}); rlkit trains on text and "
                        f"images, and its <{media[0][:-1]}> placeholders would stay in the text: "
                        "use a dataset without them")
    num = entry.get("num_samples")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise DataError(f"{where}: num_samples must be a positive integer, got {num!r}")
    file_path = os.path.join(os.path.dirname(info_path), entry["file_name"])
    records, source, in_files = _read_container(file_path, split)
    return Records(records, source, DatasetEntry(where, formatting, columns, entry.get("tags"), num,
                                                 bool(entry.get("ranking"))), in_files)


def _read_container(path: str, split: str | None) -> tuple[Iterator[Record], str, dict[str, tuple[str, ...]]]:
    """The rows of a saved dataset, a file, a glob or a folder of files; the source to name in
    messages; each table file's columns."""
    if _is_saved_dataset(path):
        return _read_saved_dataset(path, split), path, {}
    files = shard_files(path, split)
    if files is None:
        if os.path.isdir(path):
            raise DataError(f"{path}: folder is neither a saved dataset (save_to_disk) nor holds a "
                            f"dataset_info.json or files of rows ({SUPPORTED})")
        if not os.path.exists(path):
            raise DataError(f"{path}: file not found")
        if kind_of(path) is None:
            raise DataError(f"{path}: unsupported file type (expected {SUPPORTED}, a dataset_info.json, "
                            "a glob or folder of such files, or a folder saved with datasets save_to_disk)")
        files = [path]
    rows, columns = read_shards(files)
    return rows, files[0] if len(files) == 1 else path, columns
