"""Preference pairs from every form a TRL or LLaMA-Factory user brings (`rlkit/data/preference.py`):
TRL's explicit prompt (standard and conversational) and implicit prompt, LLaMA-Factory's ranking
entries (alpaca and sharegpt, as its dpo_en_demo and dpo_zh_demo lay them out, in a
dataset_info.json); bad rows are one line naming the file, the row and the column; a pair's tokens
are its sides' SFT renderings split where they part."""

from __future__ import annotations

import json

import pytest

from rlkit.data.preference import encode_pair, load_pairs
from rlkit.errors import DataError

SKY = [{"role": "user", "content": "What color is the sky?"}]


def _write(path, rows):
    text = "\n".join(json.dumps(r) for r in rows) if path.suffix == ".jsonl" else json.dumps(rows, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _lf_dir(tmp_path):
    _write(tmp_path / "dpo_zh_demo.json", [
        {"conversations": [{"from": "human", "value": "天空是什么颜色?"}],
         "chosen": {"from": "gpt", "value": "蓝色"}, "rejected": {"from": "gpt", "value": "绿色"}}])
    _write(tmp_path / "dpo_alpaca.json", [
        {"instruction": "2+2", "input": "", "chosen": "4", "rejected": "5", "history": [["1+1", "2"]]}])
    info = {"dpo_zh_demo": {"file_name": "dpo_zh_demo.json", "ranking": True, "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
            "dpo_alpaca": {"file_name": "dpo_alpaca.json", "ranking": True,
                           "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                       "rejected": "rejected", "history": "history"}},
            "plain": {"file_name": "dpo_alpaca.json"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return str(tmp_path)


def test_every_form_reads_as_the_same_kind_of_pair(tmp_path):
    standard = load_pairs(_write(tmp_path / "s.json", [{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}]))
    assert standard.rows[0] == {"instruction": "2+2=", "input": "", "system": "", "history": [], "chosen": " 4",
                                "rejected": " 5"}
    chat = load_pairs(_write(tmp_path / "c.json", [
        {"prompt": SKY, "chosen": [{"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "assistant", "content": "Green."}]}]))
    implicit = load_pairs(_write(tmp_path / "i.jsonl", [
        {"chosen": SKY + [{"role": "assistant", "content": "Blue."}],
         "rejected": SKY + [{"role": "assistant", "content": "Green."}]}]))
    assert chat.rows[0] == implicit.rows[0] == {"messages": SKY, "chosen": "Blue.", "rejected": "Green."}
    (tmp_path / "lf").mkdir()
    lf = _lf_dir(tmp_path / "lf")
    zh = load_pairs(lf, dataset="dpo_zh_demo").rows[0]
    assert zh == {"messages": [{"role": "user", "content": "天空是什么颜色?"}], "chosen": "蓝色", "rejected": "绿色"}
    alpaca = load_pairs(lf, dataset="dpo_alpaca").rows[0]
    assert (alpaca["instruction"], alpaca["history"], alpaca["chosen"], alpaca["rejected"]) == (
        "2+2", [["1+1", "2"]], "4", "5")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "a"}, "row 1: field 'rejected' is missing"),
    ({"prompt": "q", "chosen": "a", "rejected": " a "}, "row 1: fields 'chosen' and 'rejected' are the same text"),
    ({"prompt": SKY, "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
     "row 1: field 'chosen' must be one non-empty assistant message"),
    ({"prompt": SKY + [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
     "row 1: field 'prompt': the prompt must end with a 'user' message"),
])
def test_a_bad_pair_is_one_line_naming_file_row_and_column(tmp_path, row, message):
    path = _write(tmp_path / "bad.json", [row])
    with pytest.raises(DataError) as e:
        load_pairs(path)
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    assert len(load_pairs(_write(tmp_path / "mixed.json", [good, row, good]), skip_bad_rows=True).rows) == 2


def test_a_dataset_info_entry_without_ranking_is_refused_in_one_line(tmp_path):
    with pytest.raises(DataError, match=r"dataset 'plain': is not a ranking dataset"):
        load_pairs(_lf_dir(tmp_path), dataset="plain")


def test_a_pair_is_its_sides_sft_tokens_split_where_they_part(tmp_path, tiny_model):
    """Alpaca template and the chat template: the prompt is the SFT prompt, each side its SFT
    response with the eos, so chosen's row is byte for byte what SFT trains on that response."""
    from transformers import AutoTokenizer

    from rlkit.data.collate import encode_sft
    from rlkit.data.preference import side_rows
    from rlkit.data.store import IGNORE_INDEX

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    for path, template in ((_write(tmp_path / "s.json", [{"prompt": "2+2=", "chosen": "4", "rejected": "5 or 6"}]),
                            "alpaca"), (_write(tmp_path / "c.json", [{"prompt": SKY, "chosen": "Blue.",
                                                                      "rejected": "Green."}]), "chat")):
        pair = load_pairs(path).rows[0]
        enc = encode_pair(pair, tokenizer, template)
        for side, row in zip(("chosen", "rejected"), side_rows(pair)):
            sft = encode_sft(row, tokenizer, template, 4096, mask_history=True)
            assert enc["prompt_ids"] + enc[f"{side}_ids"] == sft["input_ids"]
            assert enc[f"{side}_ids"] == [t for t in sft["labels"] if t != IGNORE_INDEX]
            assert enc[f"{side}_ids"][-1] == tokenizer.eos_token_id
        assert enc["chosen_ids"] != enc["rejected_ids"]


def test_a_pair_keeps_its_difficulty_and_margin_and_a_bad_margin_is_one_line(tmp_path):
    """The curriculum's `difficulty` and TRL's reward-model `margin` ride along to the micro-batch."""
    from rlkit.dpo.objective import preference_batch

    rows = [{"prompt": "q", "chosen": "a", "rejected": "b", "difficulty": "explain", "margin": 0.5},
            {"prompt": "r", "chosen": "c", "rejected": "d", "difficulty": "topology", "margin": 2}]
    pairs = load_pairs(_write(tmp_path / "m.json", rows)).rows
    assert [(p["difficulty"], p["margin"]) for p in pairs] == [("explain", 0.5), ("topology", 2.0)]
    batch = preference_batch([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "margin": p["margin"]}
                              for p in pairs], 0)
    assert batch["margin"].tolist() == [0.5, 2.0]
    path = _write(tmp_path / "bad.json", [{**rows[0], "margin": "high"}])
    with pytest.raises(DataError, match=r"bad.json: row 1: field 'margin' must be a number, got str$"):
        load_pairs(path)
