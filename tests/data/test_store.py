"""The driver's compact store of tokenised SFT samples gives back exactly what was put in."""

import pytest

from rlkit.data.store import IGNORE_INDEX, TokenRows


def test_samples_come_back_as_they_went_in_at_five_bytes_a_token():
    samples = [{"input_ids": [5, 900, 70000, 2], "labels": [IGNORE_INDEX, IGNORE_INDEX, 70000, 2]},
               {"input_ids": [1], "labels": [1]},
               {"input_ids": [3, 4], "labels": [IGNORE_INDEX, 9], "note": "its own labels"},   # outside the rule
               {"input_ids": [8, 8, 8], "labels": [IGNORE_INDEX] * 3, "images": ["a.png"]}]
    rows = TokenRows(samples)
    assert len(rows) == 4 and list(rows) == samples and rows[-1] == samples[-1]
    assert rows[1:3] == samples[1:3] and rows[::2] == samples[::2]
    assert list(rows.lengths()) == [4, 1, 2, 3]
    assert rows.nbytes() == 10 * 5 + 5 * 8
    with pytest.raises(IndexError):
        rows[4]
    with pytest.raises(ValueError, match="2 input_ids and 1 labels"):
        rows.append({"input_ids": [1, 2], "labels": [1]})


def test_an_sft_dataset_is_held_compactly(task_data):
    from rlkit.data.collate import encode_sft
    from rlkit.data.formats import load_rows
    from rlkit.sft.config import SFTDataConfig
    from rlkit.sft.run import load_sft_data
    from rlkit.tiny import build_tokenizer

    tokenizer = build_tokenizer(512)
    data = load_sft_data(SFTDataConfig(train=str(task_data["sft_train"]), template="alpaca", cutoff_len=64), tokenizer)
    want = [encode_sft(r, tokenizer, "alpaca", 64) for r in load_rows(str(task_data["sft_train"])).rows]
    assert isinstance(data.train, TokenRows) and list(data.train) == want
    tokens = sum(len(s["input_ids"]) for s in want)
    assert data.train.nbytes() < 6 * tokens   # a list of Python ints costs about 70 bytes a token with its labels


def test_packed_rows_give_back_copies_and_equal_a_list_of_the_rows(task_data):
    from rlkit.data.formats import load_rows
    from rlkit.data.store import PackedRows

    rows = [{"prompt": "1+1=", "answer": "2", "images": None}, {"messages": [{"role": "user", "content": "你好"}]}]
    packed = PackedRows(rows)
    assert packed == rows and rows == list(packed) and packed[-1] == rows[-1] and packed[:1] == rows[:1]
    assert packed + packed[:1] == [*rows, rows[0]] and rows[:1] + packed == [rows[0], *rows]
    packed[0]["answer"] = "3"     # a copy: the store keeps the row as read
    assert packed[0]["answer"] == "2" and packed != [rows[0]] and packed != rows[::-1]
    loaded = load_rows(str(task_data["sft_train"]))
    assert isinstance(loaded.rows, PackedRows)
    assert loaded.rows.nbytes() < 1.5 * task_data["sft_train"].stat().st_size   # about the file's own size
