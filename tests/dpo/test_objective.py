"""A DPO micro-batch through rlkit's objective (`rlkit/dpo/objective.py`: one forward of the chosen
and rejected rows, rlkit's head, the reference's logprobs as the learner attaches them) against TRL
1.16's `DPOTrainer.compute_loss` on the same tiny model, rows and batch: loss, every parameter's
gradient and TRL's metrics."""

from __future__ import annotations

import pytest
import torch

from rlkit.dpo.loss import DPOTerms
from rlkit.dpo.objective import DPOObjective, pair_means, preference_batch, without_padding
from rlkit.dpo.reference import ReferenceOnce, with_reference
from rlkit.dpo.run import micro_batches
from rlkit.learner.objective import MicroBatch
from tests.helpers import assert_same_grads, perturb_lora_b, trainable_grads


def _pairs(seed: int = 0) -> list[dict[str, list[int]]]:
    """Three pairs with prompts of 4-8 tokens and completions of 2-7: unequal lengths, padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, c, r in ((5, 3, 6), (8, 7, 2), (4, 5, 5)):
        ids = torch.randint(4, 400, (p + c + r,), generator=g).tolist()
        rows.append({"prompt_ids": ids[:p], "chosen_ids": ids[p:p + c], "rejected_ids": ids[p + c:]})
    return rows


RPO_LD = DPOTerms(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.3), ld_alpha=0.5)
WPO = DPOTerms(loss_type=("sigmoid", "ipo"), use_weighting=True)


@pytest.mark.parametrize("terms", [DPOTerms(), DPOTerms(loss_type=("ipo",), beta=0.5), RPO_LD,
                                   WPO],
                         ids=["sigmoid", "ipo", "rpo-ld", "wpo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_dpo_micro_batch_is_trls_dpo_trainer(tiny_model, tmp_path, terms, lora):
    _same_as_trl(tiny_model, tmp_path, terms, lora, "padded")


@pytest.mark.parametrize("variant", ["padding_free", "precomputed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_padding_free_rows_and_a_reference_computed_before_training_are_the_same_step(tiny_model, tmp_path, variant,
                                                                                       lora):
    """`dpo.padding_free` (the chosen and rejected rows as one row, the masks padded) and
    `dpo.precompute_ref_log_probs` (the reference's sequence logprobs scored before training,
    in micro-batches of 2 pairs, and carried by the pairs): the same loss, gradients and metrics
    as TRL's padded step with the reference in it (padding-free: with WPO's weights, which read
    every position's probabilities; precomputed: RPO with LD-DPO's token weights)."""
    terms = WPO if variant == "padding_free" else RPO_LD  # (TRL fails on LD-DPO with WPO: no such case)
    _same_as_trl(tiny_model, tmp_path, terms, lora, variant)


def _same_as_trl(tiny_model, tmp_path, terms, lora, variant):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from rlkit.learner.logprobs import Reference

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    rows = _pairs()
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1, report_to="none",
                     use_cpu=True, bf16=False, save_strategy="no", beta=terms.beta, loss_type=list(terms.loss_type),
                     loss_weights=list(terms.loss_weights) if terms.loss_weights else None, ld_alpha=terms.ld_alpha,
                     use_weighting=terms.use_weighting)
    text = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}])  # TRL's init reads one row
    trainer = DPOTrainer(model=load(), args=args, train_dataset=text, processing_class=tokenizer, peft_config=config)
    trainer.model.train()
    if lora:
        perturb_lora_b(trainer.model)
    else:  # the policy away from its reference (the starting model), so that each pair's rewards differ
        with torch.no_grad():
            head = trainer.model.get_output_embeddings().weight
            head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(rows)
    want = trainer.compute_loss(trainer.model, batch)
    want.backward()
    want_grads = trainable_grads(trainer.model)
    trl = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model = load()
    if lora:
        model = get_peft_model(model, config)
    model.load_state_dict(trainer.model.state_dict())
    mine = preference_batch(rows, tokenizer.pad_token_id)
    assert all(torch.equal(mine[k], batch[k]) for k in mine)  # TRL's collator's layout
    objective = DPOObjective(terms)
    reference = Reference(model, "lora" if lora else "full", load)
    if variant == "precomputed":
        class OneRank:  # the learner group's side of the call: rank 0 scores its micro-batches
            size = 1

            def logprobs(self, per_rank, model_name, positions):
                return [[reference.logprobs(mb, 1.0, positions(mb)) for mb in per_rank[0]]]

        once = ReferenceOnce("reference", terms.ld_alpha)
        scored = once.score(OneRank(), micro_batches(rows, 2, tokenizer.pad_token_id), len(rows), objective)
        mb, objective = MicroBatch(preference_batch(with_reference(rows, scored), tokenizer.pad_token_id)), \
            DPOObjective(terms, needs=())
    else:
        mb = MicroBatch(without_padding(preference_batch)(rows, tokenizer.pad_token_id) if variant == "padding_free"
                        else mine)
        mb = mb.attach("ref_logp", reference.logprobs(mb, 1.0, objective.positions(mb)))
    got, metrics = objective(model, mb)
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_same_grads(model, want_grads)
    means = pair_means({k: float(v) for k, v in metrics.items()})
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert means[key] == pytest.approx(trl[key], abs=1e-5), key
    assert means["loss"] == pytest.approx(float(want), abs=1e-5)


@pytest.mark.parametrize("loss_type, beta", [("orpo", 0.25), ("simpo", 2.0), ("cpo", 0.1)])
def test_a_reference_free_micro_batch_is_trls_orpo_or_cpo_trainer(tiny_model, tmp_path, loss_type, beta):
    """ORPO and CPO / SimPO (`dpo.loss_type` orpo, simpo, cpo) against TRL 1.16's experimental
    trainers' `get_batch_loss_metrics` on the rows their own collator made: loss, every gradient
    and TRL's metrics (ORPO's NLL covers the prompt tokens too, CPO's the completion's only)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.dpo.objective import ReferenceFreeObjective

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # noqa: E731
    text = [{"prompt": "1+2=", "chosen": "3", "rejected": "4 4"}, {"prompt": "Compute 7*8=", "chosen": "56",
                                                                    "rejected": "5"},
            {"prompt": "求值 9-3=", "chosen": "结果: 6", "rejected": "7"}]
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1, report_to="none",
                  use_cpu=True, bf16=False, save_strategy="no", beta=beta)
    if loss_type == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=load(), args=ORPOConfig(**common), train_dataset=Dataset.from_list(text),
                              processing_class=tokenizer)
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, loss_type="simpo" if loss_type == "simpo" else "sigmoid", cpo_alpha=0.4,
                         simpo_gamma=0.7)
        trainer = CPOTrainer(model=load(), args=args, train_dataset=Dataset.from_list(text), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    want, trl = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval="train")
    want.backward()
    want_grads = trainable_grads(trainer.model)

    def side(name: str, i: int) -> tuple[list[int], list[int]]:
        ids, labels = batch[f"{name}_input_ids"][i], batch[f"{name}_labels"][i]
        real = batch[f"{name}_attention_mask"][i] == 1
        return ids[real & (labels == -100)].tolist(), ids[labels != -100].tolist()

    rows = [{"prompt_ids": side("chosen", i)[0], "chosen_ids": side("chosen", i)[1],
             "rejected_ids": side("rejected", i)[1]} for i in range(3)]
    assert all(side("rejected", i)[0] == r["prompt_ids"] for i, r in enumerate(rows))
    model = load()
    objective = ReferenceFreeObjective(loss_type, beta, cpo_alpha=0.4, simpo_gamma=0.7)
    got, metrics = objective(model, MicroBatch(preference_batch(rows, tokenizer.pad_token_id)))
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_same_grads(model, want_grads)
    means = pair_means({k: float(v) for k, v in metrics.items()})
    keys = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "nll_loss", *(["log_odds_ratio", "log_odds_chosen"] if loss_type == "orpo" else [])]
    for key in keys:
        assert means[key] == pytest.approx(float(trl[key]), abs=1e-5), key


def test_a_bf16_micro_batch_is_the_fp32_one_within_bf16_noise(tiny_model):
    """The same weights in bf16 (the learners' precision with `model.dtype: bf16`) and fp32, the
    policy moved away from its reference: the loss within 0.01, each side's sequence logprob
    within 0.1 nats a token on average (bf16 keeps 8 significant bits: the learner's bound), the
    reward accuracy the same, and the gradient pointing the same way (cosine above 0.99); a wrong
    cast or position is off by whole nats."""
    from transformers import AutoModelForCausalLM

    from rlkit.learner.logprobs import Reference

    rows = _pairs()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        def load(dtype=dtype):
            return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)

        model = load()
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.add_((torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype))
        objective = DPOObjective(DPOTerms(beta=0.5))
        mb = MicroBatch(preference_batch(rows, 0))
        mb = mb.attach("ref_logp", Reference(model, "full", load).logprobs(mb, 1.0, objective.positions(mb)))
        loss, metrics = objective(model, mb)
        loss.backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results[dtype] = float(loss), pair_means({k: float(v) for k, v in metrics.items()}), grad, metrics["tokens"]
    (loss32, m32, g32, tokens), (loss16, m16, g16, _) = results[torch.float32], results[torch.bfloat16]
    assert abs(loss16 - loss32) < 0.01 and m32["rewards/margins"] != 0
    per_token = float(tokens) / len(rows) / 2
    for side in ("logps/chosen", "logps/rejected"):
        assert abs(m16[side] - m32[side]) < 0.1 * per_token, (side, m16[side], m32[side])
    assert m16["rewards/accuracies"] == m32["rewards/accuracies"]
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99
