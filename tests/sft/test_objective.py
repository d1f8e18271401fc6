"""The SFT objective equals transformers' own causal-LM loss (the peer), response tokens only."""

import pytest
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


def _rows(seed: int = 0) -> list[dict]:
    """Four rows whose responses hold 2, 9, 4 and 15 tokens (prompts of 5-8): micro-batches of one
    row each hold unequal numbers of labelled tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt, response in ((5, 2), (8, 9), (6, 4), (7, 15)):
        ids = torch.randint(4, 400, (prompt + response,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def test_a_steps_loss_and_gradient_are_trl_s_on_unequal_micro_batches(tiny_model, tmp_path):
    """One optimizer step of 4 micro-batches of one row each (2 to 15 response tokens): rlkit's
    micro-batches (`shard_step`) and objective, each loss divided by the accumulation steps as the
    learner does, give TRL 1.16's `SFTTrainer` loss and gradient (its `num_items_in_batch`: the step's
    summed NLL over its labelled tokens), not the mean of the micro-batches' token means. On two
    ranks (DeepSpeed's average of their gradients) the same gradient (TRL's default
    `average_tokens_across_devices`)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rlkit.sft.run import shard_step

    rows = _rows()
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # noqa: E731

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    grads = Grads()
    data = Dataset.from_list([{"input_ids": r["input_ids"],
                               "completion_mask": [int(x != -100) for x in r["labels"]]} for r in rows])
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                     max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=True, bf16=False, seed=0, completion_only_loss=True)
    trainer = SFTTrainer(model=load(), args=args, train_dataset=data, callbacks=[grads])
    trainer.train()
    trl_loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)

    def step(world: int, reduction: str = "rlkit") -> tuple[float, dict]:
        model, loss_sum = load(), 0.0
        shards = shard_step(rows, world, 4 // world, 1, False, 0)
        for shard in shards:  # each rank's backward, summed; DeepSpeed divides the sum by the ranks
            for mb in shard:
                if reduction == "mean":
                    mb = {k: v for k, v in mb.items() if k != "num_items_in_batch"}
                loss, _ = NLLObjective()(model, mb)
                (loss / len(shard) / world).backward()
                loss_sum += loss.item() / len(shard) / world
        return loss_sum, {n: p.grad for n, p in model.named_parameters()}

    def worst(a: dict, b: dict) -> float:
        return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)

    loss, mine = step(1)
    assert loss == pytest.approx(trl_loss, abs=1e-5)
    assert worst(mine, grads.grads) < 1e-5  # 4e-7 of a parameter's largest entry, measured
    assert worst(step(2)[1], grads.grads) < 1e-5
    assert worst(step(1, "mean")[1], grads.grads) > 0.5  # the mean of micro-batch means is another one (2.5)
