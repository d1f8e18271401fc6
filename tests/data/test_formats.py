"""Row schemas: alpaca / messages / sharegpt rows and GRPO prompt rows, validated with one-line errors."""

from __future__ import annotations

import json
import logging

import pytest

from rlkit.data.formats import load_prompts, load_rows
from rlkit.errors import DataError
from tests.data.rows import ROWS, write_json, write_jsonl


def test_alpaca_json_and_jsonl_normalised(tmp_path):
    for p in (write_json(tmp_path / "a.json", ROWS), write_jsonl(tmp_path / "a.jsonl", ROWS)):
        got = load_rows(p)
        assert got.kind == "alpaca" and got.skipped == 0 and got.source == p
        assert got.rows[0] == {"instruction": "请解释什么是深度学习", "input": "", "output": "深度学习是...",
                               "system": "", "history": [], "difficulty": "explain"}
        assert got.rows[1]["id"] == 7 and got.rows[1]["input"] == "1+2"


@pytest.mark.parametrize("bad, msg", [
    ({"instruction": "q", "output": ""}, "field 'output' is empty (expected a non-empty string)"),
    ({"instruction": "q"}, "field 'output' is missing (expected a non-empty string)"),
    ({"instruction": "q", "output": 5}, "field 'output' is int (expected a string)"),
    ({"instruction": "q", "output": ["a"]}, "field 'output' is list (expected a string)"),
    ({"output": "a"}, "field 'instruction' is missing"),
    ({"instruction": "q", "output": "a", "history": [["x"]]}, "field 'history' must be a list"),
    ("not a row", "expected a JSON object, got str"),
])
def test_bad_row_one_line_error_with_row_number(tmp_path, bad, msg):
    rows = [ROWS[0]] * 16 + [bad] + [ROWS[1]]
    p = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_rows(p, fmt="alpaca")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{p}: row 17: ") and msg in text


def test_jsonl_row_number_is_line_number(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"instruction": "q", "output": ""}) + "\n")
    with pytest.raises(DataError, match=r"t\.jsonl: row 3: field 'output' is empty"):
        load_rows(str(p))


def test_skip_bad_rows_counts_and_warns(tmp_path, caplog):
    p = write_json(tmp_path / "t.json", [ROWS[0], {"instruction": "q", "output": 1}, ROWS[1]])
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        got = load_rows(p, skip_bad_rows=True)
    assert len(got) == 2 and got.skipped == 1
    assert "skipped 1 bad row(s)" in caplog.text and "row 2" in caplog.text


def test_unknown_fmt(tmp_path):
    with pytest.raises(DataError, match="unknown format 'csv'"):
        load_rows(write_json(tmp_path / "a.json", ROWS), fmt="csv")


def test_messages_rows(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}], "difficulty": "topology"}]
    got = load_rows(write_jsonl(tmp_path / "m.jsonl", rows))
    assert got.kind == "messages" and got.rows[0]["messages"][2] == {"role": "assistant", "content": "hello"}
    assert got.rows[0]["difficulty"] == "topology"
    bad = [{"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataError, match="row 1: field 'messages': the last message must be"):
        load_rows(write_jsonl(tmp_path / "b.jsonl", bad))
    bad = [{"messages": [{"role": "bot", "content": "hi"}]}]
    with pytest.raises(DataError, match="item 1: unknown role 'bot'"):
        load_rows(write_jsonl(tmp_path / "c.jsonl", bad))


def test_load_prompts_prompt_answer_rows(tmp_path):
    rows = [{"prompt": "1+2=?", "answer": 3, "level": "easy"},
            {"prompt": [{"role": "user", "content": "2+2=?"}], "answer": "4"}]
    got = load_prompts(write_jsonl(tmp_path / "p.jsonl", rows))
    assert got.kind == "prompts"
    assert got.rows[0] == {"prompt": "1+2=?", "answer": "3", "level": "easy", "difficulty": None}
    assert got.rows[1]["prompt"] == [{"role": "user", "content": "2+2=?"}]
    # an answer column is needed in every row once the first has one; TRL-style data without it loads
    with pytest.raises(DataError, match=r"row 2: field 'answer' is missing"):
        load_prompts(write_jsonl(tmp_path / "q.jsonl", [rows[0], {"prompt": "x"}]))
    got = load_prompts(write_jsonl(tmp_path / "s.jsonl", [{"prompt": [{"role": "user", "content": "1+1?"}],
                                                           "solution": "$2$"}]))
    assert got.rows[0]["solution"] == "$2$" and "answer" not in got.rows[0]
    with pytest.raises(DataError, match=r"row 2: field 'prompt' is empty"):
        load_prompts(write_jsonl(tmp_path / "r.jsonl", [rows[0], {"prompt": " ", "answer": "1"}]))


def test_load_prompts_from_alpaca_and_messages(tmp_path):
    got = load_prompts(write_json(tmp_path / "a.json", ROWS))
    assert got.rows[1]["prompt"] == "### 指令:\n求和\n\n### 输入:\n1+2\n\n### 回答:\n"
    assert got.rows[1]["answer"] == "3" and got.rows[1]["instruction"] == "求和"
    assert "output" not in got.rows[1]
    msgs = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    got = load_prompts(write_jsonl(tmp_path / "m.jsonl", msgs))
    assert got.rows[0]["prompt"] == [{"role": "user", "content": "q"}] and got.rows[0]["answer"] == "a"
