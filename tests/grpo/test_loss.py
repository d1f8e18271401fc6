"""rlkit.grpo.loss against hand-computed values (TRL comparison: test_loss_vs_trl.py)."""

import math

import pytest
import torch

from rlkit.grpo.advantages import soft_overlong_penalty
from rlkit.grpo.loss import kl_penalty, policy_loss
from rlkit.learner.logprobs import selective_log_softmax
from rlkit.learner.objective import step_normaliser

D = torch.float64


def two_by_three():
    """old_logp = 0, logp = log(ratio); epsilon 0.2 -> clip range [0.8, 1.2].

    row 0, A=+1, ratios [1.5, 1.0, 0.5], mask [1,1,1]:
        1.5 -> -min(1.5, 1.2) = -1.2 (high-clipped); 1.0 -> -1.0; 0.5 -> -min(0.5, 0.8) = -0.5
    row 1, A=-1, ratios [0.5, 1.1, 2.0], mask [1,1,0]:
        0.5 -> -min(-0.5, -0.8) = 0.8 (low-clipped); 1.1 -> 1.1; 2.0 masked out
    """
    ratios = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.1, 2.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    return ratios.log(), torch.zeros_like(ratios), torch.tensor([1.0, -1.0], dtype=D), mask


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        # per-seq means: (-1.2 - 1.0 - 0.5)/3 = -0.9 and (0.8 + 1.1)/2 = 0.95 -> mean 0.025
        ("grpo", {}, 0.025),
        # token sum -2.7 + 1.9 = -0.8 over 5 tokens -> -0.16
        ("bnpo", {}, -0.16),
        # -0.8 / (B=2 * max_completion_length=4) = -0.1
        ("dr_grpo", {"max_completion_length": 4}, -0.1),
        # -0.8 / num_items_in_batch=10 = -0.08; default = local token count 5 -> -0.16
        ("dapo", {"num_items_in_batch": 10}, -0.08),
        ("dapo", {}, -0.16),
    ],
)
def test_loss_by_hand(loss_type, kwargs, expected):
    logp, old, adv, mask = two_by_three()
    out = policy_loss(logp, old, adv, mask, loss_type=loss_type, **kwargs)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    # 1 low-clipped (row 1 tok 0), 1 high-clipped (row 0 tok 0) out of 5 mask tokens
    assert out.clip_frac_low.item() == pytest.approx(0.2)
    assert out.clip_frac_high.item() == pytest.approx(0.2)
    assert out.clip_frac.item() == pytest.approx(0.4)
    # (1.5 + 1.0 + 0.5 + 0.5 + 1.1) / 5 = 0.92
    assert out.ratio_mean.item() == pytest.approx(0.92)
    assert out.kl_mean is None and out.entropy is None
    assert not out.clip_frac.requires_grad


def test_clip_higher_asymmetric():
    # epsilon_high 0.28 -> row 0 tok 0: -min(1.5, 1.28) = -1.28; others unchanged
    # bnpo: (-1.28 - 1.0 - 0.5 + 0.8 + 1.1) / 5 = -0.176
    logp, old, adv, mask = two_by_three()
    out = policy_loss(logp, old, adv, mask, epsilon_high=0.28, loss_type="bnpo")
    assert out.loss.item() == pytest.approx(-0.176, abs=1e-12)


def test_two_sided_delta():
    # all tokens in; row 1 tok 2: ratio 2.0, A=-1: without delta -min(-2.0, -1.2) = 2.0,
    # with delta=1.5: -min(-1.5, -1.2) = 1.5. bnpo sums: -0.8 + 2.0 = 1.2 vs -0.8 + 1.5 = 0.7 (over 6)
    logp, old, adv, _ = two_by_three()
    mask = torch.ones_like(logp)
    plain = policy_loss(logp, old, adv, mask, loss_type="bnpo").loss.item()
    two_sided = policy_loss(logp, old, adv, mask, loss_type="bnpo", delta=1.5).loss.item()
    assert plain == pytest.approx(1.2 / 6) and two_sided == pytest.approx(0.7 / 6)
    with pytest.raises(ValueError, match="delta"):
        policy_loss(logp, old, adv, mask, delta=1.1)


def test_kl_penalty_by_hand():
    # d = ref - logp = ln 2: k1 = -ln 2 = -0.693147; k2 = (ln 2)^2 / 2 = 0.240227;
    # k3 = e^{ln 2} - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853
    logp, ref = torch.zeros(1, dtype=D), torch.tensor([math.log(2)], dtype=D)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(1 - math.log(2))
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_term_in_loss():
    # zero advantages -> policy term 0; loss = beta * mean k3 = 0.1 * 0.306853 (grpo, all tokens equal)
    logp = torch.zeros(2, 3, dtype=D)
    ref = torch.full_like(logp, math.log(2))
    out = policy_loss(logp, None, torch.zeros(2, dtype=D), torch.ones_like(logp), ref_logp=ref, beta=0.1)
    assert out.loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert out.kl_mean.item() == pytest.approx(1 - math.log(2))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, None, torch.zeros(2), torch.ones_like(logp), beta=0.1)


def test_validation():
    logp, old, adv, mask = two_by_three()
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], mask)


def test_entropy_metric_and_per_token_advantages():
    logp, old, adv, mask = two_by_three()
    ent = torch.arange(6, dtype=D).view(2, 3)  # masked mean (0+1+2+3+4)/5 = 2
    out = policy_loss(logp, old, adv, mask, entropies=ent)
    assert out.entropy.item() == pytest.approx(2.0)
    out_bt = policy_loss(logp, old, adv[:, None].expand(2, 3), mask)
    assert out_bt.loss.item() == pytest.approx(out.loss.item())


def test_gradient_step_moves_logp_with_advantage_sign():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=D, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3))
    mask = torch.ones(2, 3, dtype=D)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    logp0 = selective_log_softmax(logits, ids)
    out = policy_loss(logp0, logp0.detach(), adv, mask, loss_type="bnpo")  # ratio 1: inside the clip range
    out.loss.backward()
    with torch.no_grad():
        logp1 = selective_log_softmax(logits - 0.5 * logits.grad, ids)
    assert (logp1[0] > logp0[0]).all()  # positive advantage: more likely
    assert (logp1[1] < logp0[1]).all()  # negative advantage: less likely


def test_clipped_token_has_no_gradient():
    logp, old, adv, mask = two_by_three()
    logp = logp.clone().requires_grad_(True)
    policy_loss(logp, old, adv, mask, loss_type="bnpo").loss.backward()
    # clipped tokens (0,0) and (1,0) and the masked (1,2) get 0; others -A*ratio/5
    expected = torch.tensor([[0.0, -1.0 / 5, -0.5 / 5], [0.0, 1.1 / 5, 0.0]], dtype=D)
    torch.testing.assert_close(logp.grad, expected)


def test_soft_overlong_penalty():
    # max 100, buffer 20 -> free up to 80; 90 -> (80-90)/20 = -0.5; 100 -> -1; 101 -> -1
    lengths = torch.tensor([50, 80, 90, 100, 101])
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20), torch.tensor([0, 0, -0.5, -1, -1]))
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20, 2.0), torch.tensor([0, 0, -1.0, -2, -2]))
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(lengths, 100, 0)


def test_step_normaliser_makes_a_global_token_mean():
    """DeepSpeed averages gradients over P ranks and divides each micro-batch loss by GA: with the
    normaliser tokens / (P * GA), P ranks x GA micro-batches of per-token losses l sum to
    sum(l) / tokens, the token mean of the whole optimizer step."""
    assert step_normaliser(120, world_size=2, grad_accum=3) == 20.0
    assert step_normaliser(0, 2, 3) == 1 / 6  # no loss token: clamped to one, no division by zero
    # 2 ranks x 2 micro-batches with 3, 5, 1, 7 loss tokens, each token's loss 1.0:
    tokens = [3, 5, 1, 7]
    norm = step_normaliser(sum(tokens), 2, 2)
    per_micro = [policy_loss(torch.zeros(1, n, dtype=D), None, torch.tensor([-1.0], dtype=D),
                             torch.ones(1, n, dtype=D), loss_type="dapo", num_items_in_batch=norm).loss
                 for n in tokens]  # ratio 1, A = -1: every token's loss is exactly 1
    step = sum(per_micro) / 2 / 2  # DeepSpeed: / GA per micro-batch, then the mean over 2 ranks
    assert step.item() == pytest.approx(1.0)  # the mean over all 16 tokens
    # fewer loss tokens (2) than ranks x micro-batches (4): the normaliser is 0.5, and still the mean
    tokens = [1, 0, 0, 1]
    norm = step_normaliser(sum(tokens), 2, 2)
    per_micro = [policy_loss(torch.zeros(1, n, dtype=D), None, torch.tensor([-1.0], dtype=D),
                             torch.ones(1, n, dtype=D), loss_type="dapo", num_items_in_batch=norm).loss
                 for n in tokens]
    assert (sum(per_micro) / 2 / 2).item() == pytest.approx(1.0)


# --- GSPO sequence ratios, CISPO, SAPO, the correction weights (TRL comparison: test_loss_vs_trl.py) --


def test_sequence_level_ratio_is_the_geometric_mean_per_sequence():
    # row 0 log-ratios [ln 1.5, 0, ln 0.5] -> mean ln(0.75)/3 -> w0 = 0.75^(1/3) (unclipped, A > 0);
    # row 1 [ln 0.5, ln 1.1] -> w1 = 0.55^(1/2) = 0.7416 < 0.8, A < 0 -> clipped at 0.8, loss +0.8
    logp, old, adv, mask = two_by_three()
    out = policy_loss(logp, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence")
    w0 = 0.75 ** (1 / 3)
    assert out.loss.item() == pytest.approx((-w0 + 0.8) / 2, abs=1e-12)
    assert out.clip_frac_low.item() == pytest.approx(0.5)  # one of two sequences


def test_cispo_caps_the_detached_weight():
    # weights min(r, 1.2): [1.2, 1.0, 0.5 | 0.5, 1.1]; loss = -sum(w * A * logp) / tokens
    logp, old, adv, mask = two_by_three()
    logp = logp.clone().requires_grad_(True)
    out = policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon_high=1.2)
    w = torch.tensor([[1.2, 1.0, 0.5], [0.5, 1.1, 0.0]], dtype=D)
    want = -(w * adv[:, None] * logp.detach() * mask).sum() / 5
    assert out.loss.item() == pytest.approx(want.item(), abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, -(w * adv[:, None] * mask) / 5)  # no gradient through the weight
    assert out.clip_frac.item() == pytest.approx(1 / 5)  # row 0 tok 0: r 1.5 > 1.2 with A > 0


def test_sapo_soft_gate_by_hand():
    # per token -sigmoid(tau (r - 1)) * 4 / tau * A, tau 1 for A > 0, 1.05 for A < 0; grpo-style mean
    logp, old, adv, mask = two_by_three()
    out = policy_loss(logp, old, adv, mask, loss_type="sapo")
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row0 = [-sig(r - 1) * 4 for r in (1.5, 1.0, 0.5)]
    row1 = [sig(1.05 * (r - 1)) * 4 / 1.05 for r in (0.5, 1.1)]
    assert out.loss.item() == pytest.approx((sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-12)
    assert out.clip_frac is None


def test_correction_weights_and_keep_scale_only_the_policy_term():
    logp, old, adv, mask = two_by_three()
    ref = logp + 0.1
    base = policy_loss(logp, old, adv, mask, loss_type="bnpo", ref_logp=ref, beta=0.5)
    kl_part = policy_loss(logp, old, adv, mask * 0 + mask, loss_type="bnpo", ref_logp=ref, beta=0.5,
                          keep=torch.zeros(2, 1, dtype=D))  # every sequence dropped: only the KL is left
    weighted = policy_loss(logp, old, adv, mask, loss_type="bnpo", ref_logp=ref, beta=0.5,
                           is_weights=torch.full((2, 3), 2.0, dtype=D))
    assert kl_part.loss.item() == pytest.approx(0.5 * kl_part.kl_mean.item(), abs=1e-12)
    assert weighted.loss.item() == pytest.approx(2 * base.loss.item() - kl_part.loss.item(), abs=1e-12)
