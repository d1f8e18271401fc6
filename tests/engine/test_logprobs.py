"""Token logprobs: selective log-softmax and entropy against direct formulas, temperature scaling."""

import math

import pytest
import torch

from rlkit.engine.logprobs import entropy_from_logits, selective_log_softmax, token_logprobs

D = torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_selective_log_softmax_matches_gather(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    ref = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, ids), ref)
    with pytest.raises(ValueError, match="ids shape"):
        selective_log_softmax(logits, ids[:, :2])


def test_entropy_from_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=D)
    p = logits.softmax(-1)
    ref = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), ref)  # 15 rows in 4 chunks
    # uniform over V=11 -> ln 11
    assert entropy_from_logits(torch.zeros(1, 1, 11)).item() == pytest.approx(math.log(11), rel=1e-6)


def test_token_logprobs_scale_logits_by_temperature(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 230, 41]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float() / 0.7
        logp, entropy = token_logprobs(model, batch, 0.7, with_entropy=True)
    want = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(entropy, -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))
