"""Load and validate training data: alpaca, chat messages, prompt/answer rows.

Where the records come from (JSON/JSONL, parquet, CSV, Arrow files and shards of them,
dataset_info.json, save_to_disk folders) is `sources.py`; every error names the file and the
row, or, for a table file without a column the format needs, the file and the column.

Row schemas (``fmt``): ``alpaca`` (instruction/input/output/system/history), ``messages``
(list of {role, content}), ``sharegpt`` (``conversations`` of {from, value}); ``auto`` picks
from the first row. Rows are normalised; columns the schema does not name are kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlkit.data.containers import check_columns
from rlkit.data.images import (
    IMAGE_COLUMNS,
    ImageRowError,
    check_count,
    content_parts,
    count_placeholders,
    row_images,
)
from rlkit.data.sources import MEDIA_COLUMNS, DatasetEntry, Peeked, Record, drop_kto_false, read_records
from rlkit.data.store import PackedRows
from rlkit.data.templates import render_alpaca, row_turns
from rlkit.errors import DataError

log = logging.getLogger("rlkit")

ROLES = ("system", "user", "assistant")
ROW_FORMATS = ("auto", "alpaca", "messages", "sharegpt")
ALPACA_COLUMNS = {"instruction": "instruction", "input": "input", "output": "output",
                  "system": "system", "history": "history"}
# LLaMA-Factory `columns` keys -> our alpaca field names.
_LF_ALPACA_KEYS = {"prompt": "instruction", "query": "input", "response": "output",
                   "system": "system", "history": "history"}
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                  "assistant_tag": "gpt", "system_tag": "system"}
_OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                "assistant_tag": "assistant", "system_tag": "system"}
# turns of function-calling data (LLaMA-Factory's observation/function_call, OpenAI's tool)
_TOOL_ROLES = ("tool", "function", "function_call", "observation", "ipython")


@dataclass(frozen=True)
class LoadedRows:
    """Validated rows (packed: indexing gives a copy; ``list(rows)`` to edit them). kind: 'alpaca' |
    'messages' | 'prompts'; skipped: bad rows dropped."""

    rows: Sequence[dict[str, Any]]
    kind: str
    skipped: int
    source: str

    def __len__(self) -> int:
        return len(self.rows)


class _RowError(Exception):
    """A problem with one row; the caller adds file and row number."""


@dataclass(frozen=True)
class _Schema:
    """How to read one row: alpaca column names, or messages column + role tags."""

    kind: str  # "alpaca" | "messages"
    columns: dict[str, str]  # our field -> source column
    tags: dict[str, str] | None = None  # role_tag, content_tag, source role -> our role
    kto_tag: str | None = None  # column of LLaMA-Factory's KTO tag: rows tagged false are dropped
    images: str | None = None  # column of image paths a dataset_info entry names (None: images or image)


def _messages_schema(fmt: str, columns: dict[str, str] | None = None,
                     tags: dict[str, str] | None = None, kto_tag: str | None = None) -> _Schema:
    if fmt == "messages":
        return _Schema("messages", {"messages": "messages", "system": "system"},
                       {"role_tag": "role", "content_tag": "content",
                        **{r: r for r in ROLES}, "tool": "tool"})
    t = {**(_OPENAI_TAGS if fmt == "openai" else _SHAREGPT_TAGS), **(tags or {})}
    cols = {"messages": "messages" if fmt == "openai" else "conversations", "system": "system", **(columns or {})}
    return _Schema("messages", cols, {
        "role_tag": t["role_tag"], "content_tag": t["content_tag"],
        t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system"}, kto_tag)


def _entry_schema(entry: DatasetEntry, fmt: str) -> _Schema:
    """The row schema a dataset_info.json entry declares (its `columns` renames our fields)."""
    columns = dict(entry.columns)
    kto = columns.pop("kto_tag", None)
    images = columns.pop("images", None)
    asked = {"sharegpt": "sharegpt", "openai": "sharegpt"}.get(entry.formatting, "alpaca")
    if fmt not in ("auto", asked):
        raise DataError(f"{entry.where}: formatting is {entry.formatting!r} but format {fmt!r} was asked for")
    if entry.formatting in ("sharegpt", "openai"):
        if "tools" in columns:
            raise DataError(f"{entry.where}: has tools (column {columns['tools']!r}); function-calling "
                            "data is not supported yet: use a dataset without tool turns")
        return replace(_messages_schema(entry.formatting, {k: v for k, v in columns.items()
                                                           if k in ("messages", "system")}, entry.tags, kto),
                       images=images)
    bad = sorted(set(columns) - set(_LF_ALPACA_KEYS))
    if bad:
        raise DataError(f"{entry.where}: unknown column key {bad[0]!r} "
                        f"(expected {', '.join(_LF_ALPACA_KEYS)}, kto_tag, images)")
    return _Schema("alpaca", {**ALPACA_COLUMNS, **{_LF_ALPACA_KEYS[k]: v for k, v in columns.items()}},
                   kto_tag=kto, images=images)


def _open(path: str, fmt: str, dataset: str | None, split: str | None,
          seed: int = 0) -> tuple[Peeked, str, _Schema | None, dict[str, tuple[str, ...]]]:
    """The records, to be read once; the schema is known for dataset_info entries, else None; each
    table file's columns. Rows a KTO tag marks false are dropped (a count goes to the log)."""
    if fmt not in ROW_FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r} (expected one of {', '.join(ROW_FORMATS)})")
    got = read_records(path, dataset, split, seed)
    schema = _entry_schema(got.entry, fmt) if got.entry else None
    records = got.records
    if schema is not None and schema.kto_tag:
        records = drop_kto_false(records, schema.kto_tag, got.source)
    return Peeked(records), got.source, schema, got.columns


def _schema_columns(schema: _Schema) -> tuple[list[str], str]:
    """The columns a schema cannot do without, and what to call its rows in a message."""
    if schema.kind == "alpaca":
        return [schema.columns["instruction"], schema.columns["output"]], "alpaca rows (instruction, output)"
    return [schema.columns["messages"]], f"chat rows ({schema.columns['messages']!r} messages)"


def _detect_schema(records: Peeked, fmt: str, source: str) -> _Schema:
    if fmt == "alpaca":
        return _Schema("alpaca", dict(ALPACA_COLUMNS))
    if fmt in ("messages", "sharegpt"):
        return _messages_schema(fmt)
    first = records.first
    if first is None:
        raise DataError(f"{source}: no rows")
    if "messages" in first:
        return _messages_schema("messages")
    if "conversations" in first:
        return _messages_schema("sharegpt")
    if "instruction" in first or "output" in first:
        return _Schema("alpaca", dict(ALPACA_COLUMNS))
    raise DataError(f"{source}: row {records.head[0][0]}: cannot tell the format (expected "
                    "'instruction'/'output', 'messages' or 'conversations'; set fmt)")


# ---------------------------------------------------------------- row validation

def _opt_str(row: dict, col: str) -> str:
    v = row.get(col)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _RowError(f"field {col!r} is {type(v).__name__} (expected a string)")
    return v


def _req_str(row: dict, col: str) -> str:
    if row.get(col) is None:
        raise _RowError(f"field {col!r} is missing (expected a non-empty string)")
    v = _opt_str(row, col)
    if not v.strip():
        raise _RowError(f"field {col!r} is empty (expected a non-empty string)")
    return v


def _difficulty(row: dict) -> Any:
    """The row's `difficulty`, unchecked: only the curriculum reads it (a level name or a
    number), and it checks the values when it is on."""
    return row.get("difficulty")


def _no_media(row: dict) -> None:
    media = next((k for k in MEDIA_COLUMNS if k not in IMAGE_COLUMNS and row.get(k)), None)
    if media:
        raise _RowError(f"has {media}: rlkit trains on text and images, and the <{media[:-1]}> placeholders "
                        "would stay in the text; drop that column (or those rows)")


def _with_images(out: dict[str, Any], rec: dict, column: str | None, base_dir: str) -> dict[str, Any]:
    """The converted row `out` with its images (`images`, checked, paths made absolute) when the
    record `rec` has any; each must be named once in the text, or none of them. The column they
    came in stays as it was too (TRL's rewards get it by its own name)."""
    images = row_images(rec, column, base_dir)
    if images:
        check_count(count_placeholders(row_turns(out)), len(images), "its text")
        out["images"] = images
    return out


def _alpaca_row(row: dict, schema: _Schema) -> dict[str, Any]:
    c = schema.columns
    history = row.get(c["history"]) or []
    if not isinstance(history, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2
            and all(isinstance(s, str) for s in p) for p in history):
        raise _RowError(f"field {c['history']!r} must be a list of [question, answer] "
                        "string pairs")
    instruction, input_ = _opt_str(row, c["instruction"]), _opt_str(row, c["input"])
    if c["instruction"] not in row:
        raise _RowError(f"field {c['instruction']!r} is missing (expected a non-empty string)")
    if not (instruction.strip() or input_.strip()):
        raise _RowError(f"field {c['instruction']!r} is empty (expected a non-empty string)")
    out = {k: v for k, v in row.items() if k not in c.values()}
    out.update(instruction=instruction, input=input_, output=_req_str(row, c["output"]),
               system=_opt_str(row, c["system"]), history=[list(p) for p in history],
               difficulty=_difficulty(row))
    return out


def _messages(value: Any, col: str, tags: dict[str, str]) -> list[dict[str, str]]:
    """Validate a list of chat turns and map its role tags to ROLES."""
    if not isinstance(value, list) or not value:
        raise _RowError(f"field {col!r} must be a non-empty list of messages")
    rt, ct = tags["role_tag"], tags["content_tag"]
    known = [k for k in tags if k not in ("role_tag", "content_tag")]
    msgs = []
    for i, m in enumerate(value, start=1):
        if isinstance(m, dict) and tags.get("tool") == "tool" and (m.get("tool_calls") or m.get(rt) == "tool"):
            msgs.append(_tool_turn(m, col, i))  # TRL's conversational tool format
            continue
        if isinstance(m, dict) and (m.get("tool_calls") or m.get(rt) in _TOOL_ROLES):
            raise _RowError(f"field {col!r} item {i} is a tool turn ({m.get(rt)!r}); function-calling "
                            "data is supported in the messages format (TRL's: assistant tool_calls, "
                            "role 'tool', a 'tools' column): convert the rows or drop those with tool turns")
        if isinstance(m, dict) and isinstance(m.get(ct), list):  # content parts (text, image)
            m = {**m, ct: content_parts(m[ct], col, i, m.get(rt))}
        if not isinstance(m, dict) or not isinstance(m.get(rt), str) or not isinstance(m.get(ct), (str, list)):
            raise _RowError(f"field {col!r} item {i} must be an object with string "
                            f"{rt!r} and {ct!r}")
        if m[rt] not in known:
            raise _RowError(f"field {col!r} item {i}: unknown role {m[rt]!r} "
                            f"(expected one of {', '.join(known)})")
        role = tags[m[rt]]
        if role == "system" and i != 1:
            raise _RowError(f"field {col!r} item {i}: a system message may only come first")
        msgs.append({"role": role, "content": m[ct]})
    return msgs


def _tool_turn(m: dict, col: str, i: int) -> dict[str, Any]:
    """An assistant turn with `tool_calls` or a `tool` result, as TRL's conversational data has them."""
    if m.get("role") == "tool":
        if not isinstance(m.get("content"), str):
            raise _RowError(f"field {col!r} item {i}: a 'tool' message needs string content (the tool's result)")
        return {k: m[k] for k in ("role", "content", "name", "tool_call_id") if k in m}
    calls = m["tool_calls"]
    if m.get("role") != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance((c.get("function") or {}).get("name"), str) for c in calls):
        raise _RowError(f"field {col!r} item {i}: tool_calls must be on an assistant message, a list of "
                        "{'type': 'function', 'function': {'name': ..., 'arguments': {...}}}")
    return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}


def _messages_row(row: dict, schema: _Schema) -> dict[str, Any]:
    col, scol = schema.columns["messages"], schema.columns["system"]
    if col not in row:
        raise _RowError(f"field {col!r} is missing (expected a list of messages)")
    msgs = _messages(row[col], col, schema.tags or {})
    system = _opt_str(row, scol)
    if system and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system})
    if msgs[-1]["role"] != "assistant" or not (msgs[-1]["content"].strip() or msgs[-1].get("tool_calls")):
        raise _RowError(f"field {col!r}: the last message must be a non-empty 'assistant' "
                        "message (the response to train on)")
    if not any(m["role"] == "user" for m in msgs):
        raise _RowError(f"field {col!r} has no 'user' message")
    out = {k: v for k, v in row.items() if k not in (col, scol)}
    out.update(messages=msgs, difficulty=_difficulty(row))
    return out


def _validate(records: Iterable[Record], source: str, skip_bad_rows: bool,
              convert, images: str | None = None) -> tuple[PackedRows, int]:
    """Each record checked and converted as it is read, kept packed (`PackedRows`)."""
    rows, skipped, first_err = PackedRows(), 0, None
    base_dir = source if os.path.isdir(source) else os.path.dirname(source)  # relative image paths start here
    for n, rec in records:
        try:
            if not isinstance(rec, dict):
                raise _RowError(f"expected a JSON object, got {type(rec).__name__}")
            _no_media(rec)
            rows.append(_with_images(convert(rec), rec, images, base_dir))
        except (_RowError, ImageRowError) as e:
            msg = f"{source}: row {n}: {e}"
            if not skip_bad_rows:
                raise DataError(msg) from None
            skipped += 1
            first_err = first_err or msg
    if skipped:
        log.warning("skipped %d bad row(s); first: %s", skipped, first_err)
    if not rows:
        raise DataError(f"{source}: no usable rows" + (f" ({skipped} skipped)" if skipped else ""))
    return rows, skipped


def load_rows(path: str, fmt: str = "auto", dataset: str | None = None,
              skip_bad_rows: bool = False, split: str | None = None, seed: int = 0) -> LoadedRows:
    """Load SFT rows, normalised to alpaca fields or to ``messages``.

    Alpaca rows get instruction, input, output, system (str, '' when absent), history
    (list of [q, a]) and difficulty (str | None). Messages rows get ``messages`` (list of
    {role, content}, roles in ROLES, ending with a non-empty assistant turn) and difficulty.
    Raises DataError (one line: file, row, field) on the first bad row, unless
    ``skip_bad_rows`` (then counted in ``skipped``).
    """
    records, source, schema, columns = _open(path, fmt, dataset, split, seed)
    schema = schema or _detect_schema(records, fmt, source)
    check_columns(columns, *_schema_columns(schema))
    convert = (lambda r: _alpaca_row(r, schema)) if schema.kind == "alpaca" else (
        lambda r: _messages_row(r, schema))
    rows, skipped = _validate(records, source, skip_bad_rows, convert, schema.images)
    return LoadedRows(rows, schema.kind, skipped, source)


def _prompt_row(row: dict, with_answer: bool) -> dict[str, Any]:
    p = row.get("prompt")
    if isinstance(p, list):
        p = _messages(p, "prompt", {"role_tag": "role", "content_tag": "content",
                                    **{r: r for r in ROLES}})
        if p[-1]["role"] != "user":
            raise _RowError("field 'prompt': the last message must be a 'user' message")
    else:
        p = _req_str(row, "prompt")
    out = dict(row)
    out.update(prompt=p, difficulty=_difficulty(row))
    if with_answer:
        out["answer"] = _answer(row, "answer")
    return out


def _answer(row: dict, col: str) -> str:
    v = row.get(col)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)  # numeric answers (math sets) are kept as their text
    return _req_str(row, col)


def load_prompts(path: str, fmt: str = "auto", dataset: str | None = None,
                 skip_bad_rows: bool = False, split: str | None = None, seed: int = 0) -> LoadedRows:
    """Load GRPO prompt rows: ``prompt`` (str or messages ending with a user turn) and
    ``answer`` (str; numbers become their text), other columns kept (reward kwargs). When the
    first row has no ``answer`` (TRL/open-r1 data names it ``solution``, or rewards need no
    gold), no row needs one: the rewards' columns are checked against the data before launch.

    Also accepts alpaca rows (answer = output; prompt = the alpaca-template text; the
    instruction/input/system/history fields stay so ``render_prompt`` can re-render them
    with the chat template) and messages rows (prompt = all turns before the last
    assistant turn, answer = its content).
    """
    records, source, schema, columns = _open(path, fmt, dataset, split, seed)
    first = records.first or {}
    if schema is None and fmt == "auto" and "prompt" in first:
        check_columns(columns, ["prompt"], "GRPO prompt rows")
        convert = lambda r: _prompt_row(r, "answer" in first)  # noqa: E731
    else:
        schema = schema or _detect_schema(records, fmt, source)
        check_columns(columns, *_schema_columns(schema))
        convert = (lambda r: _alpaca_prompt(_alpaca_row(r, schema))) if schema.kind == "alpaca" \
            else (lambda r: _messages_prompt(_messages_row(r, schema)))
    rows, skipped = _validate(records, source, skip_bad_rows, convert, schema.images if schema else None)
    return LoadedRows(rows, "prompts", skipped, source)


def _alpaca_prompt(row: dict[str, Any]) -> dict[str, Any]:
    row["answer"] = row.pop("output")
    row["prompt"] = render_alpaca(row["instruction"], row["input"], row["system"], row["history"])
    return row


def _messages_prompt(row: dict[str, Any]) -> dict[str, Any]:
    msgs = row.pop("messages")
    row.update(prompt=msgs[:-1], answer=msgs[-1]["content"])
    return row
