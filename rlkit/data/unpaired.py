"""Unpaired preference rows (KTO): a prompt, one completion and whether it is desirable, read from
every source `sources.py` reads and tokenised with the SFT templates.

Row forms (`fmt: auto` tells them apart by the first row's columns, or the dataset_info entry):
- TRL's unpaired preference: ``prompt`` (a string, or messages ending with a user turn),
  ``completion`` (a string, or a list holding one assistant message) and ``label`` (true: desirable);
- LLaMA-Factory's KTO entries (a dataset_info.json entry whose ``columns`` name a ``kto_tag``):
  alpaca rows (``instruction``, ``input``, ``system``, ``history``, the response in ``output``) and
  sharegpt rows (a conversation ending with the assistant's response), the tag their label;
- any preference pair form `preference.py` reads: each pair becomes two rows, its chosen side
  desirable and its rejected side not (TRL's `unpair_preference_dataset`).
"""

from __future__ import annotations

from typing import Any

from rlkit.data.containers import check_columns
from rlkit.data.formats import LoadedRows, _messages, _RowError, _validate
from rlkit.data.preference import (
    _OPENAI,
    _extras,
    _prompt_messages,
    _text,
    alpaca_prompt,
    encode_response,
    explicit_prompt,
    load_pairs,
    response,
    with_response,
)
from rlkit.data.schema import ALPACA_COLUMNS, messages_schema
from rlkit.data.sources import Peeked, read_records
from rlkit.errors import DataError

_LF_KEYS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
            "history": "history", "kto_tag": "kto_tag"}


def _label(row: dict, col: str) -> bool:
    v = row.get(col)
    if not isinstance(v, bool):
        raise _RowError(f"field {col!r} must be true (a desirable completion) or false, got "
                        f"{'nothing' if v is None else type(v).__name__}")
    return v


def _trl(row: dict) -> dict[str, Any]:
    return {**explicit_prompt(row, _OPENAI), "completion": response(row, "completion", _OPENAI),
            "label": _label(row, "label")}


def _alpaca(row: dict, cols: dict[str, str]) -> dict[str, Any]:
    return {**alpaca_prompt(row, cols), "completion": _text(row, cols["output"]), "label": _label(row, cols["kto_tag"])}


def _sharegpt(row: dict, col: str, tags: dict[str, str], tag: str) -> dict[str, Any]:
    msgs = _messages(row.get(col), col, tags)
    if len(msgs) < 2 or msgs[-1]["role"] != "assistant" or not msgs[-1]["content"].strip():
        raise _RowError(f"field {col!r} must end with the assistant's (non-empty) response")
    return {**_prompt_messages(msgs[:-1], col), "completion": msgs[-1]["content"], "label": _label(row, tag)}


def _is_pairs(first: dict, entry: Any) -> bool:
    if entry is not None:
        return entry.ranking
    return "chosen" in first or "rejected" in first


def load_unpaired(path: str, fmt: str = "auto", dataset: str | None = None, skip_bad_rows: bool = False,
                  split: str | None = None, seed: int = 0) -> LoadedRows:
    """Unpaired rows: a prompt (alpaca fields, or ``messages`` ending with a user turn), its
    ``completion`` string, its ``label`` (desirable or not) and its ``difficulty`` where it has one.
    Preference pairs give two rows each. A bad row is one DataError naming the file, the row and
    the column (or counted and skipped with `skip_bad_rows`)."""
    if fmt != "auto":
        raise DataError(f"{path}: data.format {fmt!r}: preference data is read with format auto (its columns "
                        "say which form it is)")
    got = read_records(path, dataset, split, seed)
    records, source, entry = Peeked(got.records), got.source, got.entry
    first = records.first if isinstance(records.first, dict) else {}
    if _is_pairs(first, entry):
        pairs = load_pairs(path, fmt, dataset, skip_bad_rows, split, seed)
        rows = [{**{k: v for k, v in p.items() if k not in ("chosen", "rejected", "margin")},
                 "completion": p[side], "label": side == "chosen"}
                for p in pairs.rows for side in ("chosen", "rejected")]
        return LoadedRows(rows, "unpaired", pairs.skipped, pairs.source)
    convert, needed = _converter(first, entry, source)
    check_columns(got.columns, needed, "unpaired preference rows")
    rows, skipped = _validate(records, source, skip_bad_rows, lambda r: {**convert(r), **_extras(r)})
    if all(r["label"] for r in rows) or not any(r["label"] for r in rows):
        which = "desirable" if rows[0]["label"] else "undesirable"
        raise DataError(f"{source}: every row is labelled {which}; KTO needs desirable and undesirable "
                        "completions (label true and false)")
    return LoadedRows(rows, "unpaired", skipped, source)


def _converter(first: dict, entry: Any, source: str) -> tuple[Any, list[str]]:
    """How each row of this source becomes an unpaired row, and the columns that must be there."""
    if entry is not None:
        columns = dict(entry.columns)
        if "kto_tag" not in columns:
            raise DataError(f"{entry.where}: names no kto_tag column (and is not a ranking dataset): KTO trains on "
                            "completions labelled desirable or not")
        if entry.formatting in ("sharegpt", "openai"):
            tags = messages_schema(entry.formatting, None, entry.tags).tags
            col = columns.get("messages", "messages" if entry.formatting == "openai" else "conversations")
            return (lambda r: _sharegpt(r, col, tags, columns["kto_tag"])), [col, columns["kto_tag"]]
        bad = sorted(set(columns) - set(_LF_KEYS))
        if bad:
            raise DataError(f"{entry.where}: unknown column key {bad[0]!r} (expected {', '.join(_LF_KEYS)})")
        cols = {**ALPACA_COLUMNS, **{_LF_KEYS[k]: v for k, v in columns.items()}}
        return (lambda r: _alpaca(r, cols)), [cols["instruction"], cols["output"], cols["kto_tag"]]
    if "prompt" in first and "completion" in first:
        return _trl, ["prompt", "completion", "label"]
    raise DataError(f"{source}: cannot tell the unpaired format from the first row (expected 'prompt', 'completion' "
                    "and 'label' (TRL), preference pairs, or a dataset_info.json entry with a kto_tag column)")


def encode_unpaired(row: dict[str, Any], tokenizer: Any, template: str) -> dict[str, Any]:
    """`prompt_ids`, `completion_ids` (untruncated) and `label` of a row: rendered as its SFT row
    (`encode_response`), as a pair's side is."""
    base = {k: v for k, v in row.items() if k not in ("completion", "label")}
    prompt, completion = encode_response(with_response(base, row["completion"]), tokenizer, template)
    return {"prompt_ids": prompt, "completion_ids": completion, "label": bool(row["label"])}
