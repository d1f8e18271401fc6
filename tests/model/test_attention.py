"""rlkit's attention for padding-free rows (`attention.py`): sdpa on each sequence of a
packed row. Padded batches get exactly transformers' sdpa; packed rows score and train as the
padded batch does (fp32 within 1e-6, gradients in fp64 within 1e-12)."""

from __future__ import annotations

import json

import pytest
import torch

from rlkit.learner.logprobs import token_logprobs
from rlkit.model.attention import PACKED_SDPA, packed_sdpa, sequence_bounds, use_packed_attention
from tests.sides import assert_packed_as_padded


def _model(tiny_model, dtype=torch.float32, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype, attn_implementation=attn)


def test_sdpa_models_switch_and_the_saved_config_does_not_carry_it(tiny_model, tmp_path):
    from rlkit.config import ModelConfig
    from rlkit.model.load import load_model

    model = load_model(ModelConfig(path=str(tiny_model)), torch.float32)
    assert model.config._attn_implementation == PACKED_SDPA  # every model rlkit loads to train or score
    eager = _model(tiny_model, attn="eager")
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path / "saved")
    assert PACKED_SDPA not in (tmp_path / "saved" / "config.json").read_text()
    assert "attn" not in "".join(json.loads((tmp_path / "saved" / "config.json").read_text()))


def test_a_padded_batch_is_transformers_sdpa_bit_for_bit(tiny_model):
    ids = torch.tensor([[5, 17, 99, 230, 41, 7], [5, 6, 7, 9, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    plain, ours = _model(tiny_model), _model(tiny_model)
    assert use_packed_attention(ours)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, ours(**batch).logits)


def test_a_packed_row_scores_and_trains_as_the_padded_batch(tiny_model):
    from rlkit.grpo.batch import GRPOBatch, Rollout

    rs = [Rollout([5, 17, 99], [230, 41, 7, 8], False), Rollout([5, 6], [7, 9], False),
          Rollout([11, 12, 13, 14, 15], [16], False)]
    b = GRPOBatch.collate(rs, torch.tensor([1.0, -0.5, 0.3]), pad_id=0)
    padded, packed = b.micro_batch([0, 1, 2]), b.packed_micro_batch([0, 1, 2])
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        model = _model(tiny_model, dtype)
        assert use_packed_attention(model)
        results, grads = [], []
        for mb in (padded, packed):
            positions = mb["completion_mask"][:, 1:].bool()
            logp, entropy = token_logprobs(model, mb, 0.9, with_entropy=True, positions=positions)
            (logp * torch.tensor([[1.0], [-2.0], [0.5]], dtype=logp.dtype)).sum().backward()
            results.append((logp.detach(), entropy))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        assert_packed_as_padded(results, grads, dtype, tol)


def test_sequence_bounds_and_a_windowed_layer_keeps_its_mask(tiny_model):
    model = _model(tiny_model)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert sequence_bounds(model, positions) == {}  # plain sdpa finds them itself (and builds a mask)
    use_packed_attention(model)
    got = sequence_bounds(model, positions)
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 5, 6] and got["max_length_q"] == 3
    # a sliding-window layer: the window is in the mask transformers built, so it is used as it is
    layer = model.model.layers[0].self_attn
    q, k, v = (torch.randn(1, n, 6, 32) for n in (4, 2, 2))
    mask = torch.tensor([[True, False, False, False, False, False], [True, True, False, False, False, False]] * 3)
    mask = mask[None, None]
    want, _ = packed_sdpa(layer, q, k, v, mask, scaling=0.5)
    got, _ = packed_sdpa(layer, q, k, v, mask, scaling=0.5, sliding_window=4, **sequence_bounds(model, positions))
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 2])
def test_a_sequence_of_one_or_two_tokens(tiny_model, n):
    model = _model(tiny_model)
    use_packed_attention(model)
    ids, positions = [5, 17, 99] + [7, 9][:n], [0, 1, 2] + [0, 1][:n]
    row = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions])}
    with torch.no_grad():
        packed = model(**row, **sequence_bounds(model, row["position_ids"])).logits[0]
        alone = [model(input_ids=row["input_ids"][:, a:b]).logits[0] for a, b in ((0, 3), (3, 3 + n))]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
