"""Load and validate training data: alpaca, chat messages, prompt/answer rows.

Where the records come from (JSON/JSONL, parquet, CSV, Arrow files and shards of them,
dataset_info.json, save_to_disk folders) is `sources.py`; every error names the file and the
row, or, for a table file without a column the format needs, the file and the column.

How a file's rows are read (the row schema: ``alpaca``, ``messages``, ``sharegpt``, or ``auto``
from the first row) is `schema.py`'s. Rows are normalised; columns the schema does not name are kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
from rlkit.data.schema import ROLES, Schema, detect_schema, open_records, schema_columns
from rlkit.data.sources import MEDIA_COLUMNS, Record
from rlkit.data.store import PackedRows
from rlkit.data.templates import render_alpaca, row_turns
from rlkit.errors import DataError

log = logging.getLogger("rlkit")

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


def _alpaca_row(row: dict, schema: Schema) -> dict[str, Any]:
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


def _messages_row(row: dict, schema: Schema) -> dict[str, Any]:
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
    records, source, schema, columns = open_records(path, fmt, dataset, split, seed)
    schema = schema or detect_schema(records, fmt, source)
    check_columns(columns, *schema_columns(schema))
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
    records, source, schema, columns = open_records(path, fmt, dataset, split, seed)
    first = records.first or {}
    if schema is None and fmt == "auto" and "prompt" in first:
        check_columns(columns, ["prompt"], "GRPO prompt rows")
        convert = lambda r: _prompt_row(r, "answer" in first)  # noqa: E731
    else:
        schema = schema or detect_schema(records, fmt, source)
        check_columns(columns, *schema_columns(schema))
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
