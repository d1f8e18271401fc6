"""Data sources: JSON, JSONL, LLaMA-Factory dataset_info.json entries, save_to_disk folders;
errors name the file."""

from __future__ import annotations

import json

import pytest

from rlkit.data.formats import load_rows
from rlkit.errors import DataError
from tests.data.rows import ROWS, write_json, write_jsonl


def test_json_file_holding_json_lines_is_read(tmp_path):
    p = write_jsonl(tmp_path / "lines.json", ROWS)
    assert len(load_rows(p)) == 2


@pytest.mark.parametrize("name, content, msg", [
    ("missing.json", None, "file not found"),
    ("bad.json", '[{"instruction": "q",', "line 1: invalid JSON"),
    ("bad.jsonl", json.dumps(ROWS[0]) + "\n{oops\n", "line 2: invalid JSON"),
    ("data.xlsx", "a,b\n", "unsupported file type"),
    ("obj.json", '{"a": 1,\n "b": 2}', "expected a JSON list"),
])
def test_file_errors_name_the_file(tmp_path, name, content, msg):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert str(e.value).startswith(str(p)) and msg in str(e.value) and "\n" not in str(e.value)


def test_dataset_info_alpaca_columns(tmp_path):
    write_json(tmp_path / "custom_data.json",
               [{"q": "请解释", "ctx": "", "a": "好的", "sys": "你是老师", "difficulty": "explain"}])
    info = {"custom_dataset": {"file_name": "custom_data.json", "formatting": "alpaca",
                               "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    for path in (str(tmp_path), str(tmp_path / "dataset_info.json")):
        got = load_rows(path, dataset="custom_dataset")
        assert got.kind == "alpaca" and got.source.endswith("custom_data.json")
        assert got.rows == [{"instruction": "请解释", "input": "", "output": "好的", "system": "你是老师",
                             "history": [], "difficulty": "explain"}]
    with pytest.raises(DataError, match=r"dataset 'nope' not found \(available: custom_dataset\)"):
        load_rows(str(tmp_path), dataset="nope")
    with pytest.raises(DataError, match="name the dataset"):
        load_rows(str(tmp_path))


def test_dataset_info_alpaca_default_columns_seed_example(tmp_path):
    # the seed's example: columns map prompt/query/response to the alpaca names
    write_json(tmp_path / "custom_data.json", ROWS)
    info = {"custom_dataset": {"file_name": "custom_data.json", "formatting": "alpaca",
                               "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    assert load_rows(str(tmp_path), dataset="custom_dataset").rows[1]["output"] == "3"


def test_dataset_info_sharegpt(tmp_path):
    conv = [{"conversations": [{"from": "human", "value": "你好"}, {"from": "gpt", "value": "您好"}],
             "sys": "be nice"}]
    write_jsonl(tmp_path / "chat.jsonl", conv)
    info = {"chat": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "system": "sys"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    got = load_rows(str(tmp_path), dataset="chat")
    assert got.kind == "messages"
    assert got.rows[0]["messages"] == [{"role": "system", "content": "be nice"},
                                       {"role": "user", "content": "你好"},
                                       {"role": "assistant", "content": "您好"}]


def test_saved_hf_dataset_and_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    got = load_rows(str(tmp_path / "ds"))
    assert got.kind == "alpaca" and got.rows[1]["output"] == "3" and got.rows[0]["history"] == []
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(str(tmp_path / "dd"))) == 2
    assert len(load_rows(str(tmp_path / "dd"), split="test")) == 1
    with pytest.raises(DataError, match=r"split 'dev' not found \(available: train, test\)"):
        load_rows(str(tmp_path / "dd"), split="dev")
    bad = datasets.Dataset.from_list([{"instruction": "q", "output": "a"}, {"instruction": "q", "output": ""}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="bad: row 2: field 'output' is empty"):
        load_rows(str(tmp_path / "bad"))
