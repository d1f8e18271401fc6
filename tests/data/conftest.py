"""Fixtures for tests/data: a tiny byte-level BPE tokenizer built offline."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    words = ["指令", "输入", "回答", "解释", "深度学习", "机器学习", "神经网络", "问题", "答案",
             "hello", "world", "the", "answer", "is", "what", "explain", "reasoning", "topology",
             "system", "user", "assistant", "###", ":", "\n", "1", "2", "3", "+", "="]
    lines = []
    for i in range(300):
        w = [words[(i * k + k) % len(words)] for k in range(1, 9)]
        lines.append(f"### 指令:\n{' '.join(w)}\n\n### 回答:\n{''.join(w[:3])} {i}")
    return lines


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 pad_token="<|pad|>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = CHAT_TEMPLATE
    return hf
