"""Exact template strings (alpaca from the seeds, chat via the tokenizer)."""

from __future__ import annotations

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
