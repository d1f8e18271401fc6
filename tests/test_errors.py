"""`errors.read_json`: the one reader of a user's JSON file (a DeepSpeed config, a model's
config.json, a dataset_info.json): every problem is one line naming the file."""

from __future__ import annotations

import pytest

from rlkit.errors import DataError, UserError, read_json


@pytest.mark.parametrize("text, said", [
    (None, "x.json: file not found"),
    ('{"a": 1,\n  "b": }', "x.json: line 2: invalid JSON (Expecting value)"),
    ("[1, 2]", "x.json: expected a JSON object of entries, got list"),
    (b"\xff\xfe", "x.json: cannot read file ("),
])
def test_each_problem_is_one_line_naming_the_file(tmp_path, monkeypatch, text, said):
    monkeypatch.chdir(tmp_path)
    if isinstance(text, bytes):
        (tmp_path / "x.json").write_bytes(text)
    elif text is not None:
        (tmp_path / "x.json").write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_json("x.json", dict, "a JSON object of entries", DataError)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_the_value_comes_back_when_it_is_what_was_expected(tmp_path):
    (tmp_path / "x.json").write_text('{"a": [1, 2]}', encoding="utf-8")
    assert read_json(tmp_path / "x.json") == {"a": [1, 2]}
    (tmp_path / "y.json").write_text("[1]", encoding="utf-8")
    assert read_json(tmp_path / "y.json", list, "a list") == [1]
    with pytest.raises(UserError, match="expected a list, got dict"):
        read_json(tmp_path / "x.json", list, "a list")
