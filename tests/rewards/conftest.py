"""Fixtures: tiny offline models (random init, tokenizer trained here) for reward tests."""

import pytest

CORPUS = ["the answer is 42", "1 + 1 = 2", "hello world", "答案是 五", "<think> step </think> <answer> 4 </answer>"] * 4


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def _config(cls, tok, **kw):
    return cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, **kw)


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory):
    """Directory of a random-init Qwen2ForSequenceClassification with one label."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_rm")
    tok = _tokenizer(path)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(_config(Qwen2Config, tok, num_labels=1))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
