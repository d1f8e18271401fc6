"""Tokenisation with response-only loss, truncation, padding and packing."""

from __future__ import annotations

import pytest

from rlkit.data.collate import (
    IGNORE_INDEX,
    encode_sft,
    pack_bins,
    pack_collate,
    pad_collate,
    truncate_lengths,
)

ROW = {"instruction": "请解释什么是深度学习", "input": "", "output": "深度学习是机器学习",
       "system": "", "history": [], "difficulty": None}


@pytest.mark.parametrize("p, r, cutoff, want", [
    (3, 4, 10, (3, 4)),     # fits
    (2, 20, 8, (2, 6)),     # short prompt: response cut from the right
    (10, 4, 8, (4, 4)),     # long prompt: response kept, prompt cut from the left
    (10, 20, 8, (4, 4)),    # both long: response gets half
    (5, 3, 1, (0, 1)),      # cutoff 1: one response token
    (7, 1, 2, (1, 1)),
])
def test_truncate_lengths(p, r, cutoff, want):
    assert truncate_lengths(p, r, cutoff) == want


def test_encode_sft_masks_prompt_and_appends_eos(tokenizer):
    prompt = "### 指令:\n请解释什么是深度学习\n\n### 回答:\n"
    p = tokenizer(prompt)["input_ids"]
    r = tokenizer("深度学习是机器学习", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    got = encode_sft(ROW, tokenizer, "alpaca", cutoff_len=512)
    assert got["input_ids"] == p + r
    assert got["labels"] == [IGNORE_INDEX] * len(p) + r
    assert got["labels"][-1] == tokenizer.eos_token_id == 0
    trained = [t for t in got["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "深度学习是机器学习<|endoftext|>"


def test_encode_sft_exact_positions_small_row(tokenizer):
    row = {**ROW, "instruction": "hello", "output": "world"}
    got = encode_sft(row, tokenizer, "alpaca", cutoff_len=512)
    n_prompt = len(tokenizer("### 指令:\nhello\n\n### 回答:\n")["input_ids"])
    n_resp = len(tokenizer("world", add_special_tokens=False)["input_ids"]) + 1
    masked = [i for i, t in enumerate(got["labels"]) if t == IGNORE_INDEX]
    assert masked == list(range(n_prompt))
    assert len(got["input_ids"]) == n_prompt + n_resp


def test_encode_sft_truncation_keeps_prompt_tail_and_response_head(tokenizer):
    full = encode_sft(ROW, tokenizer, "alpaca", cutoff_len=512)
    n_p = full["labels"].count(IGNORE_INDEX)
    n_r = len(full["input_ids"]) - n_p
    cutoff = 6
    p_keep, r_keep = truncate_lengths(n_p, n_r, cutoff)
    got = encode_sft(ROW, tokenizer, "alpaca", cutoff_len=cutoff)
    assert len(got["input_ids"]) == cutoff and r_keep >= 1
    assert got["input_ids"][:p_keep] == full["input_ids"][n_p - p_keep:n_p]
    assert got["input_ids"][p_keep:] == full["input_ids"][n_p:n_p + r_keep]
    assert got["labels"] == [IGNORE_INDEX] * p_keep + full["input_ids"][n_p:n_p + r_keep]


def test_encode_sft_chat(tokenizer):
    row = {"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "您好"}]}
    got = encode_sft(row, tokenizer, "chat", cutoff_len=512)
    trained = [t for t in got["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "您好<|im_end|>\n<|endoftext|>"
    assert tokenizer.decode(got["input_ids"]) == (
        "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n您好<|im_end|>\n<|endoftext|>")


def test_pad_collate_exact():
    out = pad_collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                       {"input_ids": [8], "labels": [8]}], pad_id=1)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_pack_bins_balances_rows():
    # First-fit-decreasing needs 3 rows ([6,2], [5,3], [4]: longest 8). Dealing longest-first to
    # the shortest of 3 rows: 6->r0, 5->r1, 4->r2, 3->r2 (4<5,6), 2->r1: loads 6, 7, 7 (longest 7).
    assert pack_bins([5, 3, 4, 2, 6], max_len=8) == [[4], [0, 3], [1, 2]]
    # When dealing would overflow a row, the first-fit bins are kept: [7,1], [7,1] -> loads 8, 8.
    assert pack_bins([7, 7, 1, 1], max_len=8) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, more than max_len=8"):
        pack_bins([1, 9], max_len=8)


def test_pack_collate_exact():
    a = {"input_ids": [11, 12, 13], "labels": [-100, 12, 13]}
    b = {"input_ids": [14, 15], "labels": [14, 15]}
    c = {"input_ids": [16, 17, 18, 19], "labels": [-100, -100, 18, 19]}
    out = pack_collate([a, b, c])
    assert sorted(out) == ["input_ids", "labels", "position_ids"]  # padding-free: no attention mask
    assert out["input_ids"].tolist() == [[11, 12, 13, 14, 15, 16, 17, 18, 19]]
    assert out["labels"].tolist() == [[-100, 12, 13, -100, 15, -100, -100, 18, 19]]  # no sample predicts the next
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="no samples"):
        pack_collate([])


def test_truncated_rows_are_counted_before_training(tmp_path, tokenizer, caplog):
    """Rows longer than cutoff_len are cut: one line says how many and the longest length
    (a warning past 10% of the rows), none when nothing is cut."""
    import json
    import logging

    from rlkit.sft.config import SFTDataConfig
    from rlkit.sft.run import load_sft_data

    rows = [{"instruction": "q", "output": "a"}] * 8 + [{"instruction": "q", "output": "很长的回答" * 20}] * 2
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    full = encode_sft({**ROW, "instruction": "q", "output": "很长的回答" * 20}, tokenizer, "alpaca", 10**6)
    with caplog.at_level(logging.INFO, logger="rlkit"):
        data = load_sft_data(SFTDataConfig(train=str(path), cutoff_len=32), tokenizer)
    assert all(len(s["input_ids"]) <= 32 for s in data.train)
    line = f"rows.jsonl: 2 of 10 rows (20%) are longer than data.cutoff_len 32 tokens and are cut " \
           f"(longest {len(full['input_ids'])}); raise cutoff_len"
    assert line in caplog.text and caplog.records[-1].levelno == logging.WARNING
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlkit"):
        assert load_sft_data(SFTDataConfig(train=str(path), cutoff_len=4096), tokenizer).notes == []
    assert "longer than data.cutoff_len" not in caplog.text
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:8] * 2 + rows[8:9]))  # 1 of 17
    data = load_sft_data(SFTDataConfig(train=str(path), cutoff_len=32), tokenizer)
    assert data.notes == [f"{path}: 1 of 17 rows (6%) are longer than data.cutoff_len 32 tokens and are cut "
                          f"(longest {len(full['input_ids'])})"]  # under 10%: a line on the console, no warning
