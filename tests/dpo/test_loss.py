"""rlkit's preference losses (`rlkit/dpo/loss.py`) against TRL 1.16's own code on the same given
tensors: `DPOTrainer._compute_loss` (every loss_type, combined losses, f-divergences, LD-DPO, WPO),
`KTOTrainer`'s arithmetic, the experimental ORPO and CPO trainers' `odds_ratio_loss` / `cpo_loss`,
and `RewardTrainer.compute_loss`. TRL's methods run unchanged on a stand-in `self` (its settings and
an accelerator of one process) and a stand-in model that returns the given per-token logprobs, so
the comparison covers TRL's arithmetic, not a copy of it: loss, gradient and metrics."""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from rlkit.dpo.loss import DPO_LOSSES, DPOTerms, cpo_loss, dpo_loss, kto_loss, orpo_loss, reward_loss, sequence_logps

B, L = 6, 12


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, x):
        return x

    gather = gather_for_metrics

    def unwrap_model(self, m):
        return m

    def autocast(self):
        return nullcontext()


class _Model(torch.nn.Module):
    """Returns the given per-token tensors as TRL's fused-head outputs."""

    is_gradient_checkpointing = False

    def __init__(self, log_probs, log_sum_sq_probs=None):
        super().__init__()
        self.out = SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs),
                                   mean_logits=torch.zeros_like(log_probs), is_top1=torch.zeros_like(log_probs).bool(),
                                   log_sum_sq_probs=log_sum_sq_probs, aux_loss=None)

    def forward(self, **_kwargs):
        return self.out


def _batch(seed: int = 0):
    """[2B, L] chosen-then-rejected rows: a prompt of 3-5 tokens, completions of unequal lengths,
    right padding; per-token logprobs (0 off the completion) for the policy and the reference."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, L, dtype=torch.long)
    for i in range(2 * B):
        start, end = 3 + i % 3, 6 + int(torch.randint(0, L - 6, (1,), generator=g))
        mask[i, start:end + 1] = 1
    attention = (mask.cumsum(1) < mask.sum(1, keepdim=True)).long() | mask
    shifted = mask[:, 1:].float()
    policy = (-torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 2 * shifted)
    ref = (-torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 2 * shifted)
    sq = -torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 0.5 + policy * 0
    return mask, attention, policy, ref, sq


def _trl_dpo(terms: DPOTerms, mask, attention, policy, ref, sq):
    from trl.trainer.dpo_trainer import DPOTrainer

    metrics = defaultdict(lambda: defaultdict(list))
    model = _Model(policy, sq)
    fake = SimpleNamespace(
        model=model, ref_model=_Model(ref), accelerator=_Accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=False, beta=terms.beta, loss_types=list(terms.loss_type),
        loss_weights=list(terms.loss_weights or [1.0] * len(terms.loss_type)), ld_alpha=terms.ld_alpha,
        f_divergence_type=terms.f_divergence_type, f_alpha_divergence_coef=terms.f_alpha_divergence_coef,
        label_smoothing=terms.label_smoothing, use_weighting=terms.use_weighting,
        args=SimpleNamespace(discopop_tau=terms.discopop_tau, gradient_checkpointing_kwargs=None),
        _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": attention, "completion_mask": mask}
    loss = DPOTrainer._compute_loss(fake, model, inputs, False)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


CASES = [DPOTerms(loss_type=(k,), label_smoothing=0.1 if k in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0)
         for k in DPO_LOSSES] + [
    DPOTerms(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5)),  # RPO
    DPOTerms(loss_type=("sigmoid", "bco_pair", "sft"), loss_weights=(0.8, 0.2, 1.0), beta=0.3),  # MPO
    DPOTerms(f_divergence_type="forward_kl"), DPOTerms(f_divergence_type="js_divergence"),
    DPOTerms(loss_type=("hinge",), f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    DPOTerms(ld_alpha=0.5), DPOTerms(loss_type=("ipo",), ld_alpha=0.2), DPOTerms(use_weighting=True),
    DPOTerms(loss_type=("discopop",), discopop_tau=0.5, beta=0.5)]


@pytest.mark.parametrize("terms", CASES, ids=lambda t: "+".join(t.loss_type) + (
    f"-{t.f_divergence_type}" if t.f_divergence_type != "reverse_kl" else "") + (
    "-ld" if t.ld_alpha else "") + ("-wpo" if t.use_weighting else ""))
def test_every_dpo_loss_is_trls_in_value_gradient_and_metrics(terms):
    mask, attention, policy, ref, sq = _batch()
    if terms.f_divergence_type == "alpha_divergence":  # TRL's clamp knows half precision and fp32 only
        policy, ref, sq = policy.float(), ref.float(), sq.float()
    tol = 1e-12 if policy.dtype == torch.float64 else 1e-6
    theirs_in = policy.clone().requires_grad_()
    want, want_metrics = _trl_dpo(terms, mask, attention, theirs_in, ref, sq)
    want.backward()
    mine_in = policy.clone().requires_grad_()
    got, metrics = dpo_loss(terms, mine_in, mask, sequence_logps(ref, mask, terms.ld_alpha), sq)
    got.backward()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(mine_in.grad, theirs_in.grad, atol=tol, rtol=tol)
    for key, value in metrics.items():
        assert float(value) == pytest.approx(want_metrics[key], abs=tol), key
    assert set(metrics) <= set(want_metrics)


def test_kto_is_trls_in_value_gradient_and_metrics():
    """KTO's arithmetic as `KTOTrainer._compute_loss` does it (both loss types, unequal weights),
    on the desirable and undesirable rows of one batch and a KL estimate."""
    from trl.trainer.kto_trainer import KTOTrainer

    g = torch.Generator().manual_seed(1)
    rows, length = 7, 10
    label = torch.tensor([True, False, True, True, False, False, True])
    mask = torch.zeros(rows, length, dtype=torch.long)
    mask[:, 4:] = 1
    policy = -torch.rand(rows, length - 1, generator=g, dtype=torch.float64) * mask[:, 1:]
    ref = -torch.rand(rows, length - 1, generator=g, dtype=torch.float64) * mask[:, 1:]
    kl_policy, kl_ref = -torch.rand(rows, generator=g, dtype=torch.float64), -torch.rand(rows, generator=g,
                                                                                      dtype=torch.float64) - 1
    for loss_type in ("kto", "apo_zero_unpaired"):
        metrics = defaultdict(lambda: defaultdict(list))
        theirs_in = policy.clone().requires_grad_()
        fake = SimpleNamespace(
            model=_Model(theirs_in), accelerator=_Accelerator(), aux_loss_enabled=False, precompute_ref_logps=True,
            calculate_KL=loss_type == "kto", beta=0.2, loss_type=loss_type, desirable_weight=1.3,
            undesirable_weight=0.7, _metrics=metrics, _total_train_tokens=0, _tp_size=1,
            _compute_kl_logps=lambda model, batch: kl_policy)
        inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
                  "label": label, "ref_logps": ref.sum(-1), "ref_KL_logps": kl_ref}
        want = KTOTrainer._compute_loss(fake, fake.model, inputs, False)
        want.backward()
        mine_in = policy.clone().requires_grad_()
        kl = (kl_policy - kl_ref).mean().clamp(min=0) if loss_type == "kto" else torch.zeros(())
        got, sums = kto_loss(loss_type, 0.2, mine_in.sum(-1), ref.sum(-1), label, kl, 1.3, 0.7)
        got.backward()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(mine_in.grad, theirs_in.grad, atol=1e-12, rtol=1e-12)
        trl = {k: v[-1] for k, v in metrics["train"].items()}
        assert float(sums["rewards/chosen_sum"] / sums["count/chosen"]) == pytest.approx(trl["rewards/chosen"])
        assert float(sums["rewards/rejected_sum"] / sums["count/rejected"]) == pytest.approx(trl["rewards/rejected"])
        assert float(sums["logps/chosen_sum"] / sums["count/chosen"]) == pytest.approx(trl["logps/chosen"])
        assert float(sums["kl"]) == pytest.approx(trl["kl"])


def test_orpo_and_cpo_simpo_are_trls():
    """ORPO's odds ratio and CPO's losses (SimPO, AlphaPO) as TRL's experimental trainers compute
    them, with the NLL term their `get_batch_loss_metrics` adds."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    g = torch.Generator().manual_seed(2)
    chosen = (-torch.rand(5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    rejected = (-torch.rand(5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    chosen.data[0] = -0.01  # near 0: where log(1 - p) cancels unless computed with care
    nll = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    fake = SimpleNamespace(beta=0.25, accelerator=_Accelerator())
    losses, *_, ratio, log_odds = ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)
    want = nll - losses.mean()
    got, metrics = orpo_loss(chosen, rejected, nll, 0.25)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.autograd.grad(got, [chosen, rejected, nll]),
                               torch.autograd.grad(want, [chosen, rejected, nll]), atol=1e-12, rtol=0)
    assert float(metrics["log_odds_ratio"]) == pytest.approx(float(ratio))
    assert float(metrics["log_odds_chosen"]) == pytest.approx(float(log_odds))
    for loss_type in ("sigmoid", "hinge", "ipo", "simpo"):
        for alpha in (0.0, 0.2):
            fake = SimpleNamespace(beta=2.0, accelerator=_Accelerator(), alpha=alpha, loss_type=loss_type,
                                   simpo_gamma=0.7, label_smoothing=0.1, cpo_alpha=0.4)
            losses, chosen_rewards, _ = CPOTrainer.cpo_loss(fake, chosen, rejected)
            want = losses.mean() + 0.4 * nll
            got, metrics = cpo_loss(loss_type, chosen, rejected, nll, 2.0, 0.4, 0.7, 0.1, alpha)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
            torch.testing.assert_close(torch.autograd.grad(got, [chosen, rejected, nll]),
                                       torch.autograd.grad(want, [chosen, rejected, nll]), atol=1e-12, rtol=0)
            assert float(metrics["rewards/chosen"]) == pytest.approx(float(chosen_rewards.mean()))


@pytest.mark.parametrize("margin,center", [(False, None), (True, 0.01)])
def test_the_reward_model_loss_is_trls(margin, center):
    from trl.trainer.reward_trainer import RewardTrainer

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(8, 1, generator=g, dtype=torch.float64, requires_grad=True)
    metrics = defaultdict(lambda: defaultdict(list))
    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accelerator(), _metrics=metrics,
                           args=SimpleNamespace(center_rewards_coefficient=center), _total_train_tokens=0,
                           aux_loss_enabled=False, _tp_size=1)
    inputs = {"input_ids": torch.ones(8, 3, dtype=torch.long), "attention_mask": torch.ones(8, 3, dtype=torch.long)}
    if margin:
        inputs["margin"] = torch.rand(4, generator=g, dtype=torch.float64)
    model = lambda **_: SimpleNamespace(logits=scores)  # noqa: E731
    want = RewardTrainer.compute_loss(fake, model, inputs)
    chosen, rejected = scores[:, 0].chunk(2)
    got, mine = reward_loss(chosen, rejected, inputs.get("margin"), center)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.autograd.grad(got, scores), torch.autograd.grad(want, scores), atol=1e-12, rtol=0)
    trl = {k: v[-1] for k, v in metrics["train"].items()}
    assert float(mine["accuracy"]) == pytest.approx(trl["accuracy"])
    assert float(mine["margin"]) == pytest.approx(trl["margin"])
