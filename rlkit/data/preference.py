"""Preference pairs (DPO and its family, the reward model): a prompt, a chosen and a rejected
response, read from every source `sources.py` reads and tokenised with the SFT templates.

Row forms (`fmt: auto` tells them apart by the first row's columns):
- TRL's explicit prompt: ``prompt`` (a string, or messages ending with a user turn), ``chosen`` and
  ``rejected`` (strings, or a list holding one assistant message);
- TRL's implicit prompt: ``chosen`` and ``rejected`` conversations only; their longest common run of
  turns is the prompt, and what follows in each is one assistant message;
- LLaMA-Factory's ``ranking: true`` entries: alpaca (``instruction``, ``input``, ``system``,
  ``history`` and ``chosen`` / ``rejected`` strings; ``columns`` renames them with its keys
  ``prompt``, ``query``, ``chosen``, ``rejected``) and sharegpt (``conversations`` ending with a
  user turn, ``chosen`` / ``rejected`` one message each, in the entry's ``tags``).
A pair becomes the SFT row of each side (`encode_pair`): alpaca fields with ``output``, or the
messages with the side's assistant turn, rendered by the same template as SFT.
"""

from __future__ import annotations

from typing import Any

from rlkit.data.containers import check_columns
from rlkit.data.formats import LoadedRows, _messages, _RowError, _validate
from rlkit.data.schema import ALPACA_COLUMNS, ROLES, messages_schema
from rlkit.data.sources import Peeked, read_records
from rlkit.errors import DataError

SIDES = ("chosen", "rejected")
_OPENAI = {"role_tag": "role", "content_tag": "content", **{r: r for r in ROLES}}
_SHAREGPT = {"role_tag": "from", "content_tag": "value", "human": "user", "gpt": "assistant", "system": "system"}
# LLaMA-Factory's alpaca `columns` keys of a ranking entry -> the fields read here
_LF_KEYS = {"prompt": "instruction", "query": "input", "system": "system", "history": "history", "chosen": "chosen",
            "rejected": "rejected"}


def _text(row: dict, col: str) -> str:
    v = row.get(col)
    if col not in row or v is None:
        raise _RowError(f"field {col!r} is missing (each pair needs a chosen and a rejected response)")
    if not isinstance(v, str) or not v.strip():
        raise _RowError(f"field {col!r} must be a non-empty string, got {type(v).__name__ if v else 'empty'}")
    return v


def _reply(value: Any, col: str, tags: dict[str, str]) -> str:
    """One assistant response: a string, one message, or a list holding one assistant message."""
    if isinstance(value, str):
        return _text({col: value}, col)
    msgs = _messages([value] if isinstance(value, dict) else value, col, tags)
    if len(msgs) != 1 or msgs[0]["role"] != "assistant" or not msgs[0]["content"].strip():
        raise _RowError(f"field {col!r} must be one non-empty assistant message (got {len(msgs)} messages, "
                        f"roles {[m['role'] for m in msgs]})")
    return msgs[0]["content"]


def _pair(prompt: dict[str, Any], chosen: str, rejected: str) -> dict[str, Any]:
    if chosen.strip() == rejected.strip():
        raise _RowError("fields 'chosen' and 'rejected' are the same text: a pair must differ")
    return {**prompt, "chosen": chosen, "rejected": rejected}


def _prompt_messages(msgs: list[dict[str, str]], col: str) -> dict[str, Any]:
    if msgs[-1]["role"] != "user":
        raise _RowError(f"field {col!r}: the prompt must end with a 'user' message (got {msgs[-1]['role']!r})")
    return {"messages": msgs}


def explicit_prompt(row: dict, tags: dict[str, str], col: str = "prompt") -> dict[str, Any]:
    """TRL's explicit prompt: messages ending with a user turn, or a string (an alpaca instruction)."""
    p = row.get(col)
    if isinstance(p, list):
        return _prompt_messages(_messages(p, col, tags), col)
    return {"instruction": _text(row, col), "input": "", "system": "", "history": []}


def response(row: dict, col: str, tags: dict[str, str]) -> str:
    """A response column: a string, one message, or a list holding one assistant message."""
    return _reply(row.get(col), col, tags) if row.get(col) is not None else _text(row, col)


def _explicit(row: dict, tags: dict[str, str], prompt_col: str = "prompt") -> dict[str, Any]:
    return _pair(explicit_prompt(row, tags, prompt_col), *(response(row, side, tags) for side in SIDES))


def _implicit(row: dict) -> dict[str, Any]:
    chosen, rejected = (_messages(row.get(side), side, _OPENAI) if isinstance(row.get(side), list)
                        else _text(row, side) for side in SIDES)
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise _RowError("has no 'prompt': chosen and rejected must then be conversations (lists of messages) "
                        "that share their prompt turns")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        raise _RowError("fields 'chosen' and 'rejected' share no prompt turns (an implicit prompt is the turns "
                        "both begin with)")
    prompt = _prompt_messages(chosen[:shared], "chosen")
    return _pair(prompt, _reply(chosen[shared:], "chosen", _OPENAI), _reply(rejected[shared:], "rejected", _OPENAI))


def alpaca_prompt(row: dict, cols: dict[str, str]) -> dict[str, Any]:
    """The prompt fields of an alpaca row (`cols`: the field each is read from), checked."""
    history = row.get(cols["history"]) or []
    if not isinstance(history, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in history):
        raise _RowError(f"field {cols['history']!r} must be a list of [question, answer] string pairs")
    instruction, input_ = row.get(cols["instruction"]) or "", row.get(cols["input"]) or ""
    if not isinstance(instruction, str) or not isinstance(input_, str) or not (instruction + input_).strip():
        raise _RowError(f"field {cols['instruction']!r} must be a non-empty string")
    return {"instruction": instruction, "input": input_, "system": row.get(cols["system"]) or "",
            "history": [list(p) for p in history]}


def _alpaca(row: dict, cols: dict[str, str]) -> dict[str, Any]:
    return _pair(alpaca_prompt(row, cols), _text(row, cols["chosen"]), _text(row, cols["rejected"]))


def _sharegpt(row: dict, cols: dict[str, str], tags: dict[str, str]) -> dict[str, Any]:
    col = cols["messages"]
    msgs = _messages(row.get(col), col, tags)
    system = row.get(cols["system"])
    if isinstance(system, str) and system and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system})
    return _pair(_prompt_messages(msgs, col), *(_reply(row.get(cols[s]), cols[s], tags) for s in SIDES))


def _extras(row: dict) -> dict[str, Any]:
    """What a pair keeps of its row's other columns: `difficulty` (the curriculum) and `margin`
    (TRL's reward-model margin: a number)."""
    out: dict[str, Any] = {}
    if row.get("difficulty") is not None:
        out["difficulty"] = row["difficulty"]
    if "margin" in row:
        if isinstance(row["margin"], bool) or not isinstance(row["margin"], (int, float)):
            raise _RowError(f"field 'margin' must be a number, got {type(row['margin']).__name__}")
        out["margin"] = float(row["margin"])
    return out


def _converter(first: dict, entry: Any, source: str) -> tuple[Any, list[str]]:
    """How each row of this source becomes a pair, and the columns that must be there."""
    columns = dict(entry.columns) if entry is not None else {}
    if entry is not None and not entry.ranking:
        raise DataError(f"{entry.where}: is not a ranking dataset (no \"ranking\": true): DPO and the reward model "
                        "train on chosen/rejected pairs")
    if entry is not None and entry.formatting in ("sharegpt", "openai"):
        tags = messages_schema(entry.formatting, None, entry.tags).tags
        cols = {"messages": "messages" if entry.formatting == "openai" else "conversations", "system": "system",
                "chosen": "chosen", "rejected": "rejected", **columns}
        return (lambda r: _sharegpt(r, cols, tags)), [cols["messages"], cols["chosen"], cols["rejected"]]
    if entry is not None or "instruction" in first:
        bad = sorted(set(columns) - set(_LF_KEYS))
        if bad:
            raise DataError(f"{entry.where}: unknown column key {bad[0]!r} (expected {', '.join(_LF_KEYS)})")
        cols = {**ALPACA_COLUMNS, "chosen": "chosen", "rejected": "rejected",
                **{_LF_KEYS[k]: v for k, v in columns.items()}}
        return (lambda r: _alpaca(r, cols)), [cols["instruction"], cols["chosen"], cols["rejected"]]
    if "conversations" in first:
        cols = {"messages": "conversations", "system": "system", "chosen": "chosen", "rejected": "rejected"}
        return (lambda r: _sharegpt(r, cols, _SHAREGPT)), ["conversations", "chosen", "rejected"]
    if "prompt" in first:
        return (lambda r: _explicit(r, _OPENAI)), ["prompt", "chosen", "rejected"]
    if "chosen" in first:
        return _implicit, ["chosen", "rejected"]
    raise DataError(f"{source}: cannot tell the preference format from the first row (expected 'prompt', 'chosen' "
                    "and 'rejected' (TRL), 'chosen' and 'rejected' conversations, or LLaMA-Factory's ranking "
                    "'instruction'/'conversations' with 'chosen' and 'rejected')")


def load_pairs(path: str, fmt: str = "auto", dataset: str | None = None, skip_bad_rows: bool = False,
               split: str | None = None, seed: int = 0) -> LoadedRows:
    """Preference pairs: each row a prompt (alpaca fields, or ``messages`` ending with a user turn)
    with ``chosen`` and ``rejected`` response strings, and its ``difficulty`` and ``margin`` (TRL's
    reward-model margin) where it has them; other columns are dropped. A bad row is one
    DataError naming the file, the row and the column (or counted and skipped with `skip_bad_rows`)."""
    if fmt != "auto":
        raise DataError(f"{path}: data.format {fmt!r}: preference data is read with format auto (its columns "
                        "say which form it is)")
    got = read_records(path, dataset, split, seed)
    records, source = Peeked(got.records), got.source
    first = records.first if isinstance(records.first, dict) else {}
    convert, needed = _converter(first, got.entry, source)
    check_columns(got.columns, needed, "preference pairs")
    rows, skipped = _validate(records, source, skip_bad_rows, lambda r: {**convert(r), **_extras(r)})
    return LoadedRows(rows, "pairs", skipped, source)


def with_response(prompt: dict[str, Any], text: str) -> dict[str, Any]:
    """The SFT row of a prompt (alpaca fields, or messages) answered with `text`: alpaca fields with
    `output`, or the messages with an assistant turn."""
    if "messages" in prompt:
        return {**prompt, "messages": prompt["messages"] + [{"role": "assistant", "content": text}]}
    return {**prompt, "output": text}


def side_rows(pair: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The SFT row of each side of a pair (`with_response`)."""
    base = {k: v for k, v in pair.items() if k not in (*SIDES, "margin")}
    return tuple(with_response(base, pair[s]) for s in SIDES)


def encode_response(row: dict[str, Any], tokenizer: Any, template: str) -> tuple[list[int], list[int]]:
    """The prompt's and the response's token ids of an SFT row (`encode_sft`, the last turn the
    target, eos appended), untruncated."""
    from rlkit.data.collate import encode_sft
    from rlkit.data.store import IGNORE_INDEX

    enc = encode_sft(row, tokenizer, template, 1 << 30, mask_history=True)
    start = next(i for i, label in enumerate(enc["labels"]) if label != IGNORE_INDEX)
    return enc["input_ids"][:start], enc["input_ids"][start:]


def encode_pair(pair: dict[str, Any], tokenizer: Any, template: str) -> dict[str, list[int]]:
    """`prompt_ids`, `chosen_ids`, `rejected_ids` of a pair, untruncated (the collator cuts, as
    TRL's does): each side rendered as its SFT row (`encode_response`); the prompt is what both
    renderings share before their targets."""
    out: dict[str, list[int]] = {}
    for side, row in zip(SIDES, side_rows(pair)):
        prompt, out[f"{side}_ids"] = encode_response(row, tokenizer, template)
        if out.setdefault("prompt_ids", prompt) != prompt:
            raise DataError("the template renders the prompt differently before each response")
    return out
