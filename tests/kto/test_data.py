"""Unpaired preference rows (`rlkit/data/unpaired.py`) from every form a TRL or LLaMA-Factory user
brings: TRL's `prompt`/`completion`/`label` (standard and conversational), LLaMA-Factory's KTO
entries (its kto_en_demo's sharegpt layout with a `kto_tag` column, and alpaca), and preference
pairs, two rows each; bad rows are one line naming the file, the row and the column."""

from __future__ import annotations

import json

import pytest

from rlkit.data.unpaired import encode_unpaired, load_unpaired
from rlkit.errors import DataError

SKY = [{"role": "user", "content": "What color is the sky?"}]


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    return str(path)


def test_every_form_reads_as_the_same_kind_of_row(tmp_path):
    standard = load_unpaired(_write(tmp_path / "s.jsonl", [{"prompt": "2+2=", "completion": "4", "label": True},
                                                            {"prompt": "2+3=", "completion": "6", "label": False}]))
    assert standard.rows[1] == {"instruction": "2+3=", "input": "", "system": "", "history": [], "completion": "6",
                                "label": False}
    chat = load_unpaired(_write(tmp_path / "c.jsonl", [
        {"prompt": SKY, "completion": [{"role": "assistant", "content": "Blue."}], "label": True},
        {"prompt": SKY, "completion": [{"role": "assistant", "content": "Green."}], "label": False}]))
    assert chat.rows[0] == {"messages": SKY, "completion": "Blue.", "label": True}
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    pairs = load_unpaired(_write(tmp_path / "p.jsonl", [{"prompt": SKY, "chosen": reply("Blue."),
                                                         "rejected": reply("Green."), "difficulty": "explain"}]))
    assert list(pairs.rows) == [{"messages": SKY, "difficulty": "explain", "completion": "Blue.", "label": True},
                                {"messages": SKY, "difficulty": "explain", "completion": "Green.", "label": False}]
    _write(tmp_path / "kto_en_demo.json", [
        {"messages": SKY + [{"role": "assistant", "content": "Blue."}], "label": True},
        {"messages": SKY + [{"role": "assistant", "content": "Green."}], "label": False}])
    _write(tmp_path / "kto_alpaca.json", [{"instruction": "2+2", "input": "", "output": "4", "tag": True},
                                          {"instruction": "2+2", "input": "", "output": "5", "tag": False}])
    info = {"kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                            "columns": {"messages": "messages", "kto_tag": "label"},
                            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                     "assistant_tag": "assistant"}},
            "kto_alpaca": {"file_name": "kto_alpaca.json", "columns": {"prompt": "instruction", "query": "input",
                                                                       "response": "output", "kto_tag": "tag"}},
            "sft": {"file_name": "kto_alpaca.json"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    assert list(load_unpaired(str(tmp_path), dataset="kto_en_demo").rows) == list(chat.rows)
    alpaca = load_unpaired(str(tmp_path), dataset="kto_alpaca").rows
    assert [(r["instruction"], r["completion"], r["label"]) for r in alpaca] == [("2+2", "4", True),
                                                                                 ("2+2", "5", False)]
    with pytest.raises(DataError, match=r"dataset 'sft'.*names no kto_tag column"):
        load_unpaired(str(tmp_path), dataset="sft")


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": "yes"}],
     r"bad\.jsonl: row 2: field 'label' must be true \(a desirable completion\) or false, got str"),
    ([{"prompt": "a", "completion": "", "label": True}], r"bad\.jsonl: row 1: field 'completion' must be a non-empty"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": True}],
     r"bad\.jsonl: every row is labelled desirable; KTO needs desirable and undesirable completions"),
    ([{"question": "a", "answer": "b"}], r"bad\.jsonl: cannot tell the unpaired format from the first row"),
])
def test_a_bad_row_is_one_line(tmp_path, rows, message):
    with pytest.raises(DataError, match=message) as e:
        load_unpaired(_write(tmp_path / "bad.jsonl", rows))
    assert "\n" not in str(e.value)


def test_a_row_is_its_sft_rendering_split_where_the_completion_starts(tiny_model):
    from transformers import AutoTokenizer

    from rlkit.data.collate import encode_sft

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    row = {"instruction": "Compute", "input": "2+2=", "system": "", "history": [], "completion": "4", "label": False}
    enc = encode_unpaired(row, tokenizer, "alpaca")
    sft = encode_sft({**row, "output": "4"}, tokenizer, "alpaca", 1 << 30, mask_history=True)
    assert enc["prompt_ids"] + enc["completion_ids"] == sft["input_ids"] and enc["label"] is False
    assert enc["completion_ids"][-1] == tokenizer.eos_token_id
