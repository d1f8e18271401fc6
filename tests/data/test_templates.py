"""Exact template strings (alpaca from the seeds, chat via the tokenizer)."""

from __future__ import annotations

import copy

import pytest

from rlkit.data.templates import render_alpaca, render_prompt, render_sft
from rlkit.errors import DataError

ROW = {"instruction": "请解释什么是深度学习", "input": "", "output": "深度学习是机器学习的一个分支",
       "system": "", "history": [], "difficulty": None}


def test_alpaca_without_input_matches_seed():
    assert render_prompt(ROW, "alpaca") == "### 指令:\n请解释什么是深度学习\n\n### 回答:\n"


def test_alpaca_with_input_matches_seed():
    row = {**ROW, "instruction": "翻译", "input": "hello"}
    assert render_prompt(row, "alpaca") == "### 指令:\n翻译\n\n### 输入:\nhello\n\n### 回答:\n"


def test_alpaca_system_and_history():
    got = render_alpaca("第二问", "", system="你是老师", history=[["第一问", "第一答"]])
    assert got == ("你是老师\n\n"
                   "### 指令:\n第一问\n\n### 回答:\n第一答\n\n"
                   "### 指令:\n第二问\n\n### 回答:\n")


def test_render_sft_alpaca():
    assert render_sft(ROW, "alpaca") == ("### 指令:\n请解释什么是深度学习\n\n### 回答:\n",
                                         "深度学习是机器学习的一个分支")


def test_chat_prompt_and_sft(tokenizer):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "你好"},
                        {"role": "assistant", "content": "您好"}]}
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(row, "chat", tokenizer) == prompt
    assert render_sft(row, "chat", tokenizer) == (prompt, "您好<|im_end|>\n")


def test_alpaca_row_with_chat_template(tokenizer):
    row = {**ROW, "instruction": "翻译", "input": "hello", "system": "S", "history": [["a", "b"]]}
    assert render_prompt(row, "chat", tokenizer) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\n翻译\n\nhello<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_messages_row_with_alpaca_template():
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}]}
    assert render_sft(row, "alpaca") == (
        "S\n\n### 指令:\nq1\n\n### 回答:\na1\n\n### 指令:\nq2\n\n### 回答:\n", "a2")


def test_prompt_rows():
    assert render_prompt({"prompt": "1+1?", "answer": "2"}, "alpaca") == "### 指令:\n1+1?\n\n### 回答:\n"


def test_prompt_row_chat(tokenizer):
    assert render_prompt({"prompt": "1+1?"}, "chat", tokenizer) == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors(tokenizer):
    with pytest.raises(DataError, match="unknown template 'llama'"):
        render_prompt(ROW, "llama", tokenizer)
    with pytest.raises(DataError, match="needs a tokenizer with a chat_template"):
        render_prompt(ROW, "chat", None)
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}]}
    with pytest.raises(DataError, match="alternating user/assistant"):
        render_sft(bad, "alpaca")


ALPACA_ROWS = [
    {"instruction": "计算", "input": "12+7", "system": "你是数学助手", "history": [["1+1", "2"], ["2+2", "4"]],
     "output": "19"},
    {"instruction": "解释深度学习", "input": "", "system": "", "history": [], "output": "神经网络"},
]


def test_auto_template_follows_the_rows(tokenizer):
    from rlkit.data.templates import resolve_template

    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert resolve_template("auto", chat, tokenizer, "d.json") == "chat"
    assert resolve_template("auto", {"prompt": [{"role": "user", "content": "a"}]}, tokenizer, "d.json") == "chat"
    assert resolve_template("auto", ALPACA_ROWS[0], tokenizer, "d.json") == "alpaca"
    assert resolve_template("auto", {"prompt": "1+1?"}, tokenizer, "d.json") == "alpaca"
    assert resolve_template("alpaca", chat, tokenizer, "d.json") == "alpaca"  # a named template is kept
    bare = copy.deepcopy(tokenizer)  # a tokenizer without a chat template
    bare.chat_template = None
    with pytest.raises(DataError, match=r"^d.json: data.template: auto renders chat rows with the tokenizer's chat "
                                        r"template, and this tokenizer has none: set data.template: alpaca"):
        resolve_template("auto", chat, bare, "d.json")


def _with_bos(tokenizer):
    """The fixture tokenizer, adding <|im_start|> as a BOS token (as Llama's adds <s>)."""
    from tokenizers import processors

    tok = copy.deepcopy(tokenizer)
    tok.bos_token = "<|im_start|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", tok.bos_token_id)])
    return tok


@pytest.mark.parametrize("bos", [False, True])
def test_the_shipped_alpaca_chat_template_gives_the_training_prompt(tokenizer, bos):
    """What a chat API renders with final/'s tokenizer is what the model was trained on: the same
    text, the same token ids (BOS included where the tokenizer adds one), the answer ending in eos."""
    from rlkit.data.collate import encode_sft
    from rlkit.data.templates import chat_template_for, served_messages

    tok = _with_bos(tokenizer) if bos else tokenizer
    served = copy.deepcopy(tok)
    served.chat_template = chat_template_for("alpaca", tok)
    assert chat_template_for("chat", tok) is None  # a chat-template model ships its own
    for row in ALPACA_ROWS:
        messages = served_messages(row)
        text = served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == (tok.bos_token if bos else "") + render_prompt(row, "alpaca")
        ids = served.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        trained = encode_sft(row, tok, "alpaca", 512, mask_history=True)
        n_prompt = trained["labels"].index(next(x for x in trained["labels"] if x != -100))
        assert list(ids) == trained["input_ids"][:n_prompt]
        full = served.apply_chat_template(messages + [{"role": "assistant", "content": row["output"]}],
                                          tokenize=False)
        assert full == text + row["output"] + tok.eos_token


def test_ship_template_writes_the_alpaca_one_and_keeps_a_chat_one(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from rlkit.data.templates import ALPACA_CHAT_TEMPLATE, ship_template

    for template, want in (("alpaca", ALPACA_CHAT_TEMPLATE), ("chat", tokenizer.chat_template)):
        tokenizer.save_pretrained(tmp_path / template)
        ship_template(tmp_path / template, template)
        assert AutoTokenizer.from_pretrained(tmp_path / template).chat_template == want
