"""How a data file's rows are read: the row schema (alpaca column names, or a messages column and
its role tags) a dataset_info.json entry declares, or that the format or the first row names.

Formats (``fmt``): ``alpaca`` (instruction/input/output/system/history), ``messages`` (list of
{role, content}), ``sharegpt`` (``conversations`` of {from, value}); ``auto`` picks from the first
row. Validating and converting the rows is `formats.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlkit.data.sources import DatasetEntry, Peeked, drop_kto_false, read_records
from rlkit.errors import DataError

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


@dataclass(frozen=True)
class Schema:
    """How to read one row: alpaca column names, or messages column + role tags."""

    kind: str  # "alpaca" | "messages"
    columns: dict[str, str]  # our field -> source column
    tags: dict[str, str] | None = None  # role_tag, content_tag, source role -> our role
    kto_tag: str | None = None  # column of LLaMA-Factory's KTO tag: rows tagged false are dropped
    images: str | None = None  # column of image paths a dataset_info entry names (None: images or image)


def messages_schema(fmt: str, columns: dict[str, str] | None = None,
                     tags: dict[str, str] | None = None, kto_tag: str | None = None) -> Schema:
    if fmt == "messages":
        return Schema("messages", {"messages": "messages", "system": "system"},
                       {"role_tag": "role", "content_tag": "content",
                        **{r: r for r in ROLES}, "tool": "tool"})
    t = {**(_OPENAI_TAGS if fmt == "openai" else _SHAREGPT_TAGS), **(tags or {})}
    cols = {"messages": "messages" if fmt == "openai" else "conversations", "system": "system", **(columns or {})}
    return Schema("messages", cols, {
        "role_tag": t["role_tag"], "content_tag": t["content_tag"],
        t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system"}, kto_tag)


def entry_schema(entry: DatasetEntry, fmt: str) -> Schema:
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
        return replace(messages_schema(entry.formatting, {k: v for k, v in columns.items()
                                                           if k in ("messages", "system")}, entry.tags, kto),
                       images=images)
    bad = sorted(set(columns) - set(_LF_ALPACA_KEYS))
    if bad:
        raise DataError(f"{entry.where}: unknown column key {bad[0]!r} "
                        f"(expected {', '.join(_LF_ALPACA_KEYS)}, kto_tag, images)")
    return Schema("alpaca", {**ALPACA_COLUMNS, **{_LF_ALPACA_KEYS[k]: v for k, v in columns.items()}},
                   kto_tag=kto, images=images)


def open_records(path: str, fmt: str, dataset: str | None, split: str | None,
          seed: int = 0) -> tuple[Peeked, str, Schema | None, dict[str, tuple[str, ...]]]:
    """The records, to be read once; the schema is known for dataset_info entries, else None; each
    table file's columns. Rows a KTO tag marks false are dropped (a count goes to the log)."""
    if fmt not in ROW_FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r} (expected one of {', '.join(ROW_FORMATS)})")
    got = read_records(path, dataset, split, seed)
    if got.entry is not None and got.entry.ranking:
        raise DataError(f"{got.entry.where}: is a ranking (chosen/rejected preference) dataset; SFT and GRPO take "
                        "no preference pairs: train on it with rlkit dpo or rlkit rm, or use its prompts with "
                        "rewards (GRPO) or its chosen answers as an SFT dataset")
    schema = entry_schema(got.entry, fmt) if got.entry else None
    records = got.records
    if schema is not None and schema.kto_tag:
        records = drop_kto_false(records, schema.kto_tag, got.source)
    return Peeked(records), got.source, schema, got.columns


def schema_columns(schema: Schema) -> tuple[list[str], str]:
    """The columns a schema cannot do without, and what to call its rows in a message."""
    if schema.kind == "alpaca":
        return [schema.columns["instruction"], schema.columns["output"]], "alpaca rows (instruction, output)"
    return [schema.columns["messages"]], f"chat rows ({schema.columns['messages']!r} messages)"


def detect_schema(records: Peeked, fmt: str, source: str) -> Schema:
    if fmt == "alpaca":
        return Schema("alpaca", dict(ALPACA_COLUMNS))
    if fmt in ("messages", "sharegpt"):
        return messages_schema(fmt)
    first = records.first
    if first is None:
        raise DataError(f"{source}: no rows")
    if "messages" in first:
        return messages_schema("messages")
    if "conversations" in first:
        return messages_schema("sharegpt")
    if "instruction" in first or "output" in first:
        return Schema("alpaca", dict(ALPACA_COLUMNS))
    raise DataError(f"{source}: row {records.head[0][0]}: cannot tell the format (expected "
                    "'instruction'/'output', 'messages' or 'conversations'; set fmt)")
