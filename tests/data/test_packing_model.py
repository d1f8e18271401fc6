"""Packed rows give the same logits as each sample run alone (tiny random Qwen2)."""

from __future__ import annotations

import pytest
import torch

from rlkit.data.collate import pack_collate


@pytest.fixture(scope="module")
def qwen_factory(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def make(attn: str):
        torch.manual_seed(0)
        cfg = Qwen2Config(attn_implementation=attn, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128)
        return Qwen2ForCausalLM(cfg).eval()
    return make


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_logits_equal_single(qwen_factory, tokenizer, attn):
    model = qwen_factory(attn)
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in (7, 5, 9, 3, 12):
        ids = torch.randint(5, len(tokenizer), (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": ids})
    batch = pack_collate(samples, max_len=16, pad_id=tokenizer.pad_token_id)
    assert len(batch["bins"]) < len(samples)  # something was actually packed
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
        for r, b in enumerate(batch["bins"]):
            start = 0
            for i in b:
                ids = torch.tensor([samples[i]["input_ids"]])
                alone = model(input_ids=ids).logits[0]
                n = ids.shape[1]
                torch.testing.assert_close(packed[r, start:start + n], alone, atol=1e-5, rtol=1e-5)
                start += n
