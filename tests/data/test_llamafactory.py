"""LLaMA-Factory data as LLaMA-Factory reads it: every assistant turn trained, KTO tags,
num_samples, openai formatting, and the entries rlkit cannot train on (one line each)."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from rlkit.data.collate import IGNORE_INDEX, encode_sft, truncate_lengths
from rlkit.data.formats import load_prompts, load_rows
from rlkit.errors import DataError

TWO_TURNS = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                          {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                          {"role": "assistant", "content": "a2"}]}


def spans(tokenizer, got):
    """The decoded runs of trained (labelled) tokens, in order."""
    out, run = [], []
    for t, lab in zip(got["input_ids"], got["labels"]):
        if lab == IGNORE_INDEX:
            if run:
                out.append(tokenizer.decode(run))
            run = []
        else:
            assert lab == t
            run.append(t)
    return out + ([tokenizer.decode(run)] if run else [])


def test_every_assistant_turn_is_a_target_alpaca_template(tokenizer):
    got = encode_sft(TWO_TURNS, tokenizer, "alpaca", cutoff_len=512)
    assert spans(tokenizer, got) == ["a1", "a2<|endoftext|>"]
    assert tokenizer.decode(got["input_ids"]) == (
        "S\n\n### 指令:\nq1\n\n### 回答:\na1\n\n### 指令:\nq2\n\n### 回答:\na2<|endoftext|>")
    # the seed's alpaca rows with `history`: the history answer is a turn too
    row = {"instruction": "q2", "input": "x", "output": "a2", "system": "", "history": [["q1", "a1"]]}
    assert spans(tokenizer, encode_sft(row, tokenizer, "alpaca", cutoff_len=512)) == ["a1", "a2<|endoftext|>"]
    # mask_history: the last turn only, as before
    last = encode_sft(TWO_TURNS, tokenizer, "alpaca", cutoff_len=512, mask_history=True)
    assert spans(tokenizer, last) == ["a2<|endoftext|>"] and last["input_ids"] == got["input_ids"]


def test_every_assistant_turn_is_a_target_chat_template(tokenizer):
    got = encode_sft(TWO_TURNS, tokenizer, "chat", cutoff_len=512)
    assert spans(tokenizer, got) == ["a1<|im_end|>\n", "a2<|im_end|>\n<|endoftext|>"]
    assert tokenizer.decode(got["input_ids"]) == tokenizer.apply_chat_template(
        TWO_TURNS["messages"], tokenize=False) + "<|endoftext|>"
    assert spans(tokenizer, encode_sft(TWO_TURNS, tokenizer, "chat", 512, mask_history=True)) == \
        ["a2<|im_end|>\n<|endoftext|>"]


def test_multi_turn_truncation_keeps_the_last_response(tokenizer):
    full = encode_sft(TWO_TURNS, tokenizer, "alpaca", cutoff_len=512)
    n_last = len(tokenizer("a2", add_special_tokens=False)["input_ids"]) + 1
    n_before = len(full["input_ids"]) - n_last
    cutoff = n_last + 4
    got = encode_sft(TWO_TURNS, tokenizer, "alpaca", cutoff_len=cutoff)
    p_keep, r_keep = truncate_lengths(n_before, n_last, cutoff)
    assert len(got["input_ids"]) == cutoff and r_keep == n_last
    assert got["input_ids"] == full["input_ids"][n_before - p_keep:]
    assert got["labels"] == full["labels"][n_before - p_keep:]


def test_a_template_that_rewrites_past_turns_says_to_mask_history(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (  # drops past assistant turns' content, as reasoning templates drop <think>
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n.<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="turn 1 differently once turn 2 follows it; set data.mask_history: true"):
        encode_sft(TWO_TURNS, tok, "chat", cutoff_len=512)
    assert spans(tok, encode_sft(TWO_TURNS, tok, "chat", 512, mask_history=True)) == \
        ["a2<|im_end|>\n<|endoftext|>"]


def write(path, rows):
    path.write_text(json.dumps(rows, ensure_ascii=False))
    return path


def lf_dir(tmp_path):
    """A LLaMA-Factory `data/` folder in the layout of its demos: an alpaca entry (one row with
    history), a sharegpt entry (from/value), a KTO entry (messages with role/content tags and a
    `label` column, as kto_en_demo), an openai entry, and entries rlkit cannot train on."""
    write(tmp_path / "alpaca_zh_demo.json", [
        {"instruction": "解释过拟合", "input": "", "output": "模型记住了训练集"},
        {"instruction": "再举个例子", "input": "", "output": "背答案的学生",
         "history": [["什么是过拟合", "记住训练集"]]}])
    write(tmp_path / "sharegpt_demo.json", [
        {"conversations": [{"from": "human", "value": "你好"}, {"from": "gpt", "value": "您好"},
                           {"from": "human", "value": "介绍拓扑"}, {"from": "gpt", "value": "拓扑研究连续变形"}],
         "system": "你是老师"}])
    write(tmp_path / "kto_demo.json", [
        {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}], "label": True},
        {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "5"}], "label": False},
        {"messages": [{"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}], "label": True},
        {"messages": [{"role": "user", "content": "4+4"}, {"role": "assistant", "content": "9"}], "label": False}])
    write(tmp_path / "openai_demo.json", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "天气?"},
                      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w"}}]},
                      {"role": "tool", "content": "晴"}, {"role": "assistant", "content": "晴天"}]}])
    write(tmp_path / "numbers.json", [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)])
    info = {
        "alpaca_zh_demo": {"file_name": "alpaca_zh_demo.json"},
        "sharegpt_demo": {"file_name": "sharegpt_demo.json", "formatting": "sharegpt",
                          "columns": {"messages": "conversations", "system": "system"}},
        "kto_demo": {"file_name": "kto_demo.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "label"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
        "openai_demo": {"file_name": "openai_demo.json", "formatting": "openai"},
        "three": {"file_name": "numbers.json", "num_samples": 3},
        "eight": {"file_name": "numbers.json", "num_samples": 8},
        "dpo_demo": {"file_name": "numbers.json", "ranking": True,
                     "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}},
        "mllm_video_demo": {"file_name": "sharegpt_demo.json", "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "videos": "videos"}},
        "tools_demo": {"file_name": "sharegpt_demo.json", "formatting": "sharegpt",
                       "columns": {"messages": "conversations", "tools": "tools"}},
        "bad_count": {"file_name": "numbers.json", "num_samples": "3"},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def test_llamafactory_layout_rows_and_loss_masks(tmp_path, tokenizer, caplog):
    """Load each entry as SFT data the way a run does and check what is trained on."""
    from rlkit.sft.config import SFTDataConfig
    from rlkit.sft.run import load_sft_data

    d = lf_dir(tmp_path)

    def trained(name, template):
        data = load_sft_data(SFTDataConfig(train=str(d), dataset=name, template=template), tokenizer)
        return [spans(tokenizer, s) for s in data.train]

    assert trained("alpaca_zh_demo", "alpaca") == [["模型记住了训练集<|endoftext|>"],
                                                   ["记住训练集", "背答案的学生<|endoftext|>"]]
    assert trained("sharegpt_demo", "chat") == [["您好<|im_end|>\n", "拓扑研究连续变形<|im_end|>\n<|endoftext|>"]]
    got = load_sft_data(SFTDataConfig(train=str(d), dataset="sharegpt_demo", template="chat"), tokenizer).train[0]
    assert tokenizer.decode(got["input_ids"]).startswith(
        "<|im_start|>system\n你是老师<|im_end|>\n<|im_start|>user\n你好")
    # KTO: the rows tagged false (5, 9) are not targets, and the log says how many were dropped
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        assert trained("kto_demo", "alpaca") == [["2<|endoftext|>"], ["6<|endoftext|>"]]
    assert "dropped 2 of 4 rows tagged label=false" in caplog.text
    # GRPO prompts from KTO data: a false row's answer is no gold either
    assert [r["answer"] for r in load_prompts(str(d), dataset="kto_demo").rows] == ["2", "6"]


def test_openai_formatting_and_tool_turns(tmp_path):
    d = lf_dir(tmp_path)
    with pytest.raises(DataError, match=r"openai_demo.json: row 2: field 'messages' item 2 is a tool turn"):
        load_rows(str(d), dataset="openai_demo")
    got = load_rows(str(d), dataset="openai_demo", skip_bad_rows=True)
    assert got.rows[0]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a"}] and got.skipped == 1


def test_num_samples_as_llamafactory_draws_them(tmp_path):
    d = lf_dir(tmp_path)
    outs = lambda rows: [r["output"] for r in rows]  # noqa: E731
    three = outs(load_rows(str(d), dataset="three", seed=0).rows)
    assert len(three) == len(set(three)) == 3
    assert outs(load_rows(str(d), dataset="three", seed=0).rows) == three            # seeded
    assert {tuple(outs(load_rows(str(d), dataset="three", seed=s).rows)) for s in range(5)} != {tuple(three)}
    eight = outs(load_rows(str(d), dataset="eight", seed=0).rows)
    assert len(eight) == 8 and set(eight) == {f"a{i}" for i in range(5)}               # all once, 3 repeats
    assert len(load_prompts(str(d), dataset="three").rows) == 3                       # GRPO prompts too


@pytest.mark.parametrize("name, message", [
    ("dpo_demo", "is a ranking (chosen/rejected preference) dataset; SFT and GRPO take no preference pairs: "
                 "train on it with rlkit dpo or rlkit rm"),
    ("mllm_video_demo", "has videos (column 'videos'); rlkit trains on text and images, and its <video> placeholders"),
    ("tools_demo", "has tools (column 'tools'); function-calling data is not supported yet"),
    ("bad_count", "num_samples must be a positive integer, got '3'"),
])
def test_entries_rlkit_cannot_train_on_are_one_line(tmp_path, name, message):
    d = lf_dir(tmp_path)
    with pytest.raises(DataError) as e:
        load_rows(str(d), dataset=name)
    assert f"dataset '{name}': {message}" in str(e.value) and "\n" not in str(e.value)


def test_rows_with_media_or_bad_kto_tags(tmp_path):
    p = write(tmp_path / "mllm.json", [{"messages": [{"role": "user", "content": "<video>这是什么"},
                                                     {"role": "assistant", "content": "猫"}],
                                        "videos": ["cat.mp4"]}])
    with pytest.raises(DataError, match=r"mllm.json: row 1: has videos: rlkit trains on text and images"):
        load_rows(str(p))
    write(tmp_path / "kto.json", [{"instruction": "q", "output": "a", "kto": "false"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"k": {"file_name": "kto.json", "columns": {"prompt": "instruction", "response": "output", "kto_tag": "kto"}},
         "all_bad": {"file_name": "kto_all.json", "columns": {"kto_tag": "kto"}}}))
    with pytest.raises(DataError, match=r"kto.json: row 1: field 'kto' \(kto_tag\) is str \(expected true or false\)"):
        load_rows(str(tmp_path), dataset="k")
    write(tmp_path / "kto_all.json", [{"instruction": "q", "output": "a", "kto": False}])
    with pytest.raises(DataError, match="every row is tagged kto=false"):
        load_rows(str(tmp_path), dataset="all_bad")
