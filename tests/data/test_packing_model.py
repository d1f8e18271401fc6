"""A packed, padding-free row gives the same logits as each sample run alone (tiny random Qwen2),
with transformers' eager and sdpa attention (a block-diagonal mask from the position restarts)
and with rlkit's per-sequence sdpa (the sequences' bounds, no mask)."""

from __future__ import annotations

import pytest
import torch

from rlkit.data.collate import pack_collate
from rlkit.model.attention import PACKED_SDPA, sequence_bounds, use_packed_attention


@pytest.fixture(scope="module")
def qwen_factory(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def make(attn: str):
        torch.manual_seed(0)
        cfg = Qwen2Config(attn_implementation="sdpa" if attn == PACKED_SDPA else attn, vocab_size=len(tokenizer),
                          hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=128)
        model = Qwen2ForCausalLM(cfg).eval()
        if attn == PACKED_SDPA:
            assert use_packed_attention(model)
        assert model.config._attn_implementation == attn
        return model
    return make


@pytest.mark.parametrize("attn", ["eager", "sdpa", PACKED_SDPA])
def test_packed_logits_equal_single(qwen_factory, tokenizer, attn):
    model = qwen_factory(attn)
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in (7, 5, 9, 3, 12):
        ids = torch.randint(5, len(tokenizer), (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": ids})
    batch = pack_collate(samples)
    bounds = sequence_bounds(model, batch["position_ids"])
    want = [0, 7, 12, 21, 24, 36] if attn == PACKED_SDPA else None  # the others find them from the positions
    assert (bounds["cu_seq_lens_q"].tolist() if bounds else None) == want
    with torch.no_grad():
        # no cache: transformers looks for the position restarts only without one (as the learner calls it)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       **bounds).logits[0]
        start = 0
        for s in samples:
            ids = torch.tensor([s["input_ids"]])
            alone = model(input_ids=ids).logits[0]
            n = ids.shape[1]
            torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=1e-5)
            start += n
