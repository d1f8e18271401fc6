"""The SFT objective equals transformers' own causal-LM loss (the peer), response tokens only."""

import torch

from rlkit.sft.objective import NLLObjective


def test_nll_equals_the_models_own_loss(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    labels = torch.tensor([[-100, -100, 7, 8, 9, 10], [-100, 12, 13, 14, -100, -100]])
    batch = {"input_ids": ids, "attention_mask": (labels != -100) | (ids != 0), "labels": labels}
    with torch.no_grad():
        loss, metrics = NLLObjective()(model, batch)
        peer = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=labels).loss
    torch.testing.assert_close(loss, peer)
    assert int(metrics["tokens"]) == 4 + 3
    torch.testing.assert_close(metrics["nll"] / metrics["tokens"], peer)
