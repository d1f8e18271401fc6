"""The GRPO objective: which logprobs it asks the learner for, and its loss on a real model equals
the pure loss on the model's token logprobs."""

import pytest
import torch

from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.objective import GRPOObjective
from rlkit.rollout.config import RolloutConfig


@pytest.mark.parametrize("algo, needs", [
    (dict(), ()),
    (dict(beta=0.1), ("ref_logp",)),
    (dict(epochs=2), ("old_logp",)),
    (dict(mini_batches=2, micro_batch_size=4), ("old_logp",)),
    # stale rollouts: the learner's own old policy; the engine's logprobs only weigh (rollout correction)
    (dict(epochs=2, beta=0.1, max_staleness=1), ("ref_logp", "old_logp")),
])
def test_needs_follow_the_recipe(algo, needs):
    objective = GRPOObjective.from_config(GRPOAlgoConfig(**algo), RolloutConfig(temperature=0.7, max_tokens=32))
    assert objective.needs == needs and objective.temperature == 0.7 and objective.max_completion_length == 32


def test_loss_is_the_policy_loss_of_the_token_logprobs(tiny_model):
    from transformers import AutoModelForCausalLM

    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.loss import policy_loss
    from rlkit.learner.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rollouts = [Rollout([5, 6, 7], [8, 9], False), Rollout([5, 6], [10, 11, 12], False)]
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -0.5]), pad_id=0)
    mb = {**batch.micro_batch([0, 1]), "num_items_in_batch": torch.tensor(2.5, dtype=torch.float64)}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(epsilon_high=0.28), RolloutConfig(temperature=0.9))
    with torch.no_grad():
        loss, metrics = objective(model, mb)
        logp, _ = token_logprobs(model, mb, 0.9)
        want = policy_loss(logp, None, mb["advantages"], mb["completion_mask"][:, 1:].float(), epsilon_high=0.28,
                           loss_type="dapo", num_items_in_batch=2.5)
    torch.testing.assert_close(loss, want.loss)
    assert set(metrics) == {"loss", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "entropy"}
    # with the engine's logprobs (as from vLLM): the mismatch metrics, and the correction weighs the loss
    engine = torch.where(mb["completion_mask"][:, 1:].bool(), logp - 0.3, torch.zeros_like(logp))
    with torch.no_grad():
        loss_c, metrics_c = objective(model, {**mb, "engine_logp": engine})
    rho = torch.exp(torch.tensor(0.3)).clamp(max=2.0)  # pi_learner / pi_engine per token, truncated at 2
    torch.testing.assert_close(loss_c, want.loss * rho)
    assert metrics_c["mismatch/logp_abs_diff_mean"].item() == pytest.approx(0.3, abs=1e-5)
    assert metrics_c["is/ratio_max"].item() == pytest.approx(float(torch.exp(torch.tensor(0.3))), abs=1e-5)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)  # on-policy: the ratio is 1
    loss, metrics = objective(model, mb)  # with gradients, as in a train step
    assert loss.requires_grad and not any(v.requires_grad for v in metrics.values())  # metrics go back detached


def test_distillation_takes_the_teachers_per_token_signal_as_advantage(tiny_model):
    """With a teacher (rlkit distill): the learner attaches its logprobs; the advantage of each token
    is reward_weight x the group advantage + coef x (log p_teacher - log p_student), so the loss
    is the policy loss with those per-token advantages; the metric is the sampled reverse KL."""
    from transformers import AutoModelForCausalLM

    from rlkit.config import ModelConfig
    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import DistillConfig
    from rlkit.grpo.loss import policy_loss
    from rlkit.learner.logprobs import token_logprobs

    distill = DistillConfig(ModelConfig(path="teacher"), coef=0.5, reward_weight=0.2)
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=1.0), distill)
    assert objective.needs == ("teacher_logp",)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rollouts = [Rollout([5, 6, 7], [8, 9], False), Rollout([5, 6], [10, 11, 12], False)]
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -0.5]), pad_id=0)
    mb = {**batch.micro_batch([0, 1]), "num_items_in_batch": torch.tensor(5.0, dtype=torch.float64)}
    mask = mb["completion_mask"][:, 1:].float()
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb, 1.0)
        teacher = torch.where(mask.bool(), logp + torch.linspace(-1, 1, logp.shape[1]), torch.zeros_like(logp))
        loss, metrics = objective(model, {**mb, "teacher_logp": teacher})
        adv = 0.2 * mb["advantages"][:, None] + 0.5 * (teacher - logp) * mask
        want = policy_loss(logp, None, adv, mask, loss_type="dapo", num_items_in_batch=5.0)
    torch.testing.assert_close(loss, want.loss)
    assert metrics["distill/reverse_kl"].item() == pytest.approx(float(((logp - teacher) * mask).sum() / mask.sum()))
    with pytest.raises(ValueError, match="coef and reward_weight are both 0"):
        DistillConfig(ModelConfig(path="t"), coef=0.0, reward_weight=0.0)


@pytest.mark.parametrize("packed", [False, True])
def test_jsd_distillation_is_trls_loss_on_the_two_models_logits(tiny_model, packed):
    """`distill.loss: jsd`: the objective asks for the teacher itself (not its logprobs) and its loss
    is coef x TRL's generalized JSD of the two models' full next-token distributions at the
    completion positions (not a tool's result), padded or padding-free, past a teacher head padded
    to more rows (a family's larger model); with reward_weight > 0 the policy loss is added."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from rlkit.config import ModelConfig
    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import DistillConfig
    from rlkit.grpo.loss import policy_loss
    from rlkit.learner.logprobs import token_logprobs

    student = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    vocab = teacher.get_output_embeddings().out_features
    teacher.resize_token_embeddings(vocab + 8, mean_resizing=False)  # lm_head rows past the tokenizer
    distill = DistillConfig(ModelConfig(path="teacher"), loss="jsd", beta=0.5, coef=2.0)
    objective = GRPOObjective.from_config(GRPOAlgoConfig(beta=0.1, epochs=2), RolloutConfig(temperature=0.8), distill)
    assert objective.needs == () and objective.uses == ("teacher",)  # no policy loss: no logprobs to attach

    # the second rollout's middle tokens are a tool's result (tool_mask 0): out of the loss
    rollouts = [Rollout([5, 6, 7], [8, 9, 4], False), Rollout([5, 6], [10, 11, 12, 13, 14, 15], False,
                                                             tool_mask=[1, 0, 0, 1, 1, 1])]
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -0.5]), pad_id=0)
    padded = {**batch.micro_batch([0, 1]), "num_items_in_batch": torch.tensor(5.0, dtype=torch.float64)}
    assert padded["completion_mask"][1].tolist() == [0, 0, 1, 0, 0, 1, 1, 1]
    mb = {**batch.packed_micro_batch([0, 1]), "num_items_in_batch": padded["num_items_in_batch"]} if packed else padded
    loss, metrics = objective(student, mb, teacher=teacher)
    loss.backward()
    assert student.get_output_embeddings().weight.grad.abs().sum() > 0  # the student learns; the teacher is frozen
    assert all(p.grad is None for p in teacher.parameters())

    with torch.no_grad():  # TRL's loss on the full logits (hidden states = logits, heads = the identity)
        inputs = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
        s_logits = student(**inputs).logits[:, :-1]
        t_logits = teacher(**inputs).logits[:, :-1, :vocab]
        mask = padded["completion_mask"][:, 1:]
        eye = torch.eye(vocab)
        want = _chunked_divergence_loss(s_logits, t_logits, eye, eye, mask, 0.5, num_items_in_batch=5.0,
                                        temperature=0.8)[0]
    torch.testing.assert_close(loss.detach(), 2.0 * want, rtol=1e-5, atol=1e-6)
    assert metrics["distill/jsd"].item() == pytest.approx(float(want) * 5.0 / int(mask.sum()), rel=1e-5)

    mixed = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.8), DistillConfig(
        ModelConfig(path="teacher"), loss="jsd", beta=0.5, coef=2.0, reward_weight=0.3))
    with torch.no_grad():
        both, metrics = mixed(student, mb, teacher=teacher)
        logp, _ = token_logprobs(student, padded, 0.8)
        policy = policy_loss(logp, None, padded["advantages"], mask.float(), loss_type="dapo", num_items_in_batch=5.0)
    torch.testing.assert_close(both, 0.3 * policy.loss + 2.0 * want, rtol=1e-5, atol=1e-6)
    assert {"distill/jsd", "clip_frac", "ratio_mean"} <= set(metrics)
    with pytest.raises(ValueError, match="applies to loss: jsd only"):
        DistillConfig(ModelConfig(path="t"), beta=0.5)
