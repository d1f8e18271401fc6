"""A KTO micro-batch through rlkit's objective (`rlkit/kto/objective.py`: the rows and their
mismatched KL rows, rlkit's head, the reference's logprobs as the learner attaches them) against
TRL 1.16's `KTOTrainer.compute_loss` on the same tiny model and rows, laid out by TRL's own
collator: loss, every parameter's gradient and TRL's metrics."""

from __future__ import annotations

import pytest
import torch

from rlkit.kto.objective import KTOObjective, kto_means, unpaired_batch
from rlkit.learner.objective import MicroBatch
from tests.helpers import assert_same_grads, perturb_lora_b, trainable_grads

TEXT = [{"prompt": "1+2=", "completion": "3", "label": True},
        {"prompt": "Compute 7*8=", "completion": "5 6 7", "label": False},
        {"prompt": "求值 9-3=", "completion": "结果: 6", "label": True},
        {"prompt": "4+4=", "completion": "9", "label": False}]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_kto_micro_batch_is_trls_kto_trainer(tiny_model, tmp_path, loss_type, lora):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from rlkit.learner.logprobs import Reference

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # noqa: E731
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none",
                     use_cpu=True, bf16=False, save_strategy="no", beta=0.3, loss_type=loss_type,
                     desirable_weight=1.3, undesirable_weight=0.6)
    trainer = KTOTrainer(model=load(), args=args, train_dataset=Dataset.from_list(TEXT), processing_class=tokenizer,
                         peft_config=config)
    trainer.model.train()
    if lora:
        perturb_lora_b(trainer.model)
    batch = next(iter(torch.utils.data.DataLoader(trainer.train_dataset, batch_size=4, shuffle=False,
                                                  collate_fn=trainer.data_collator)))
    want = trainer.compute_loss(trainer.model, batch)
    want.backward()
    want_grads = trainable_grads(trainer.model)
    trl = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ids, completion = batch["input_ids"], batch["completion_mask"]
    rows = [{"prompt_ids": ids[i][(completion[i] == 0) & (batch["attention_mask"][i] == 1)].tolist(),
             "completion_ids": ids[i][completion[i] == 1].tolist(), "label": bool(batch["label"][i])}
            for i in range(4)]
    mine = unpaired_batch(rows, tokenizer.pad_token_id, kl=loss_type == "kto")
    n = len(rows)

    def same(rows_, want_ids, want_completion):  # one width for both halves: the rest is padding
        w = want_ids.shape[1]
        assert torch.equal(mine["input_ids"][rows_, :w], want_ids) and not mine["attention_mask"][rows_, w:].any()
        assert torch.equal(mine["completion_mask"][rows_, :w], want_completion)
    same(slice(0, n), ids, completion)
    if loss_type == "kto":  # TRL's KL rows: each prompt with the previous row's completion
        same(slice(n, 2 * n), batch["KL_input_ids"], batch["KL_completion_mask"])
    model = load()
    if lora:
        model = get_peft_model(model, config)
        model.load_state_dict(trainer.model.state_dict())
    objective = KTOObjective(loss_type, 0.3, 1.3, 0.6)
    mb = MicroBatch(mine)
    mb = mb.attach("ref_logp", Reference(model, "lora" if lora else "full", load).logprobs(
        mb, 1.0, objective.positions(mb)))
    got, sums = objective(model, mb)
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_same_grads(model, want_grads)
    means = kto_means({k: float(v) for k, v in sums.items()})
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert means[key] == pytest.approx(float(trl[key]), abs=1e-5), key
    assert means["loss"] == pytest.approx(float(want), abs=1e-5)
