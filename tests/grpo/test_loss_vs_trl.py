"""rlkit.grpo math against TRL 1.16's own code on identical tensors.

Loss: TRL's real ``GRPOTrainer._compute_loss`` is called unbound with a minimal stub ``self``
that has only the attributes it reads; ``_get_per_token_logps_and_entropies`` on the *stub*
returns our tensors (no model, no third-party class patched).

Advantages: TRL computes them inline in ``_generate_and_score_completions`` (not callable in
isolation), so ``_trl_advantages`` below copies those lines verbatim from
trl/trainer/grpo_trainer.py (1.16.0, ``multi_objective_aggregation="sum_then_normalize"``, single
reward function) and uses TRL's real ``nanstd``.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl.rewards import get_soft_overlong_punishment  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from rlkit.grpo.advantages import (
    group_advantages,  # noqa: E402
    soft_overlong_penalty,  # noqa: E402
)
from rlkit.grpo.loss import policy_loss  # noqa: E402

B, T, P_LEN = 4, 6, 2


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)  # ratios spread over both clip sides
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g).abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])
    old[0, 0] = logp[0, 0].detach() - 0.5  # ratio e^0.5 = 1.65, A > 0: high-clipped
    old[1, 0] = logp[1, 0].detach() + 0.5  # ratio e^-0.5 = 0.61, A < 0: low-clipped
    lengths = torch.tensor([6, 3, 1, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ent = torch.rand(B, T, generator=g)
    return logp, old, ref, adv, mask, ent


def _trl_stub(logp, ent, *, loss_type, beta, eps_low, eps_high, delta, ga, procs, steps_per_gen, max_len,
              bias_kl=False):
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        max_completion_length=max_len,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, steps_per_generation=steps_per_gen),
        accelerator=SimpleNamespace(num_processes=procs, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )


CASES = [
    # loss_type, beta, eps_low, eps_high, delta, GA, processes, steps_per_generation
    ("grpo", 0.0, 0.2, 0.2, None, 1, 1, 1),
    ("grpo", 0.04, 0.2, 0.28, 4.0, 1, 1, 1),
    ("bnpo", 0.04, 0.2, 0.28, None, 1, 1, 1),
    ("dr_grpo", 0.04, 0.2, 0.2, None, 1, 1, 1),
    ("dapo", 0.0, 0.2, 0.28, None, 1, 1, 1),
    ("dapo", 0.04, 0.1, 0.28, 2.0, 1, 1, 1),
    # gradient accumulation / multi-rank: check the documented mapping
    ("grpo", 0.04, 0.2, 0.28, None, 4, 2, 4),
    ("bnpo", 0.0, 0.2, 0.2, None, 4, 2, 4),
    ("dr_grpo", 0.0, 0.2, 0.2, None, 2, 1, 2),
    ("dapo", 0.04, 0.2, 0.28, None, 4, 2, 8),
]


@pytest.mark.parametrize("loss_type, beta, eps_low, eps_high, delta, ga, procs, spg", CASES)
def test_policy_loss_matches_trl(loss_type, beta, eps_low, eps_high, delta, ga, procs, spg):
    logp, old, ref, adv, mask, ent = _inputs(seed=len(loss_type) + ga + int(beta * 100))
    max_len = 8
    num_items_gen = torch.tensor(37.0)  # TRL: loss tokens of the whole generation batch, all ranks
    stub = _trl_stub(
        logp, ent, loss_type=loss_type, beta=beta, eps_low=eps_low, eps_high=eps_high, delta=delta,
        ga=ga, procs=procs, steps_per_gen=spg, max_len=max_len,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, P_LEN, dtype=torch.long),
        "prompt_mask": torch.ones(B, P_LEN, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": num_items_gen,
    }
    trl_loss = GRPOTrainer._compute_loss(stub, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)

    # mapping documented in rlkit/grpo/loss.py
    n_items = num_items_gen / procs * ga / spg
    out = policy_loss(
        logp, old, adv, mask, epsilon_low=eps_low, epsilon_high=eps_high, ref_logp=ref, beta=beta,
        kl="k3", loss_type=loss_type, max_completion_length=max_len, delta=delta,
        num_items_in_batch=n_items, entropies=ent,
    )
    ours = out.loss if loss_type == "dapo" else out.loss / ga
    (our_grad,) = torch.autograd.grad(ours, logp)

    torch.testing.assert_close(ours, trl_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_grad, trl_grad, atol=1e-6, rtol=0)
    m = stub._metrics["train"]
    assert out.clip_frac_low.item() == pytest.approx(m["clip_ratio/low_mean"][0], abs=1e-6)
    assert out.clip_frac_high.item() == pytest.approx(m["clip_ratio/high_mean"][0], abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(m["clip_ratio/region_mean"][0], abs=1e-6)
    assert out.entropy.item() == pytest.approx(m["entropy"][0], abs=1e-6)
    if beta:
        assert out.kl_mean.item() == pytest.approx(m["kl"][0], abs=1e-6)
    # the cases must exercise clipping on both sides to be meaningful
    if ga == 1 and delta is None and loss_type != "dr_grpo":
        assert out.clip_frac_low > 0 and out.clip_frac_high > 0


def _trl_inputs(adv, mask, old, ref, num_items_gen):
    inputs = {"prompt_ids": torch.zeros(B, P_LEN, dtype=torch.long),
              "prompt_mask": torch.ones(B, P_LEN, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "ref_per_token_logps": ref, "num_items_in_batch": num_items_gen}
    if old is not None:  # without it TRL takes the detached policy: on-policy
        inputs["old_per_token_logps"] = old
    return inputs


@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "token"), ("cispo", "token"),
                                              ("grpo", "sequence"), ("bnpo", "token")])
@pytest.mark.parametrize("on_policy", [True, False])
def test_bias_corrected_kl_matches_trl(loss_type, level, on_policy):
    """TRL's `use_bias_correction_kl` (the KL term times the ratio): loss, gradient and KL metric equal
    on-policy (ratio 1, its gradient not 0) and off-policy; and the gradient differs from the plain k3 term."""
    logp, old, ref, adv, mask, ent = _inputs(seed=11 + len(loss_type))
    old = None if on_policy else old
    ga, procs, spg, num_items_gen, beta = 2, 2, 2, torch.tensor(37.0), 0.1
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    grads = {}
    for bias in (True, False):
        stub = _trl_stub(logp, ent, loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=eps_high, delta=None, ga=ga,
                         procs=procs, steps_per_gen=spg, max_len=8, bias_kl=bias)
        stub.importance_sampling_level = level
        trl_loss = GRPOTrainer._compute_loss(stub, None, _trl_inputs(adv, mask, old, ref, num_items_gen))
        (trl_grad,) = torch.autograd.grad(trl_loss, logp)
        out = policy_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=eps_high, ref_logp=ref, beta=beta,
                          loss_type=loss_type, importance_sampling_level=level, max_completion_length=8,
                          num_items_in_batch=num_items_gen / procs * ga / spg, entropies=ent, bias_correction_kl=bias)
        ours = out.loss if loss_type in ("dapo", "cispo") else out.loss / ga
        (grads[bias],) = torch.autograd.grad(ours, logp)
        torch.testing.assert_close(ours, trl_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grads[bias], trl_grad, atol=1e-6, rtol=0)
        assert out.kl_mean.item() == pytest.approx(stub._metrics["train"]["kl"][0], abs=1e-6)
    assert (grads[True] - grads[False]).abs().max() > 1e-4  # the weight changes the KL gradient, on-policy too


@pytest.mark.parametrize("procs, ga, tokens", [(2, 1, 1), (4, 2, 3)])
def test_token_mean_with_fewer_tokens_than_ranks_matches_trl(procs, ga, tokens):
    """A step with fewer loss tokens than ranks: TRL clamps the token count before dividing it by the
    ranks (its normaliser may then be below 1); rlkit's loss uses the normaliser it is given (the
    module doc's mapping; `step_normaliser` clamps the same way) without a second clamp."""
    logp, old, ref, adv, mask, ent = _inputs(seed=5)
    mask = torch.zeros_like(mask)
    mask[0, :tokens] = 1  # this micro-batch holds all of the step's loss tokens
    stub = _trl_stub(logp, ent, loss_type="dapo", beta=0.0, eps_low=0.2, eps_high=0.28, delta=None, ga=ga,
                     procs=procs, steps_per_gen=ga, max_len=8)
    trl_loss = GRPOTrainer._compute_loss(stub, None, _trl_inputs(adv, mask, old, ref, torch.tensor(float(tokens))))
    norm = tokens / procs * ga / ga  # the module doc's mapping, steps_per_generation = GA
    assert norm < 1  # the case: a clamp after the division would change the loss
    out = policy_loss(logp, old, adv, mask, epsilon_high=0.28, loss_type="dapo", num_items_in_batch=norm)
    torch.testing.assert_close(out.loss, trl_loss, atol=1e-6, rtol=0)


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    # Copied from trl 1.16.0 trl/trainer/grpo_trainer.py, _generate_and_score_completions,
    # `if self.multi_objective_aggregation == "sum_then_normalize":` branch (rewards already summed).
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_advantages_match_trl(scale, group_size):
    g = torch.Generator().manual_seed(group_size)
    rewards = torch.randint(0, 3, (32,), generator=g).float() / 2  # ties -> zero-std groups
    rewards[5] = float("nan")  # unscorable completion
    rewards[16:18] = float("nan")
    expected = _trl_advantages(rewards, group_size, scale)
    torch.testing.assert_close(group_advantages(rewards, group_size, scale), expected, atol=1e-6, rtol=0)


def test_soft_overlong_matches_trl():
    lengths = list(range(0, 130, 3))
    trl_vals = get_soft_overlong_punishment(100, 20)([[0] * n for n in lengths])
    ours = soft_overlong_penalty(torch.tensor(lengths), 100, 20)
    torch.testing.assert_close(ours, torch.tensor(trl_vals, dtype=ours.dtype), atol=1e-6, rtol=0)


# --- the losses TRL 1.16 added, sequence-level ratios, rollout correction, GDPO --------------------

NEW_CASES = [
    # loss_type, importance_sampling_level, beta, eps_high, IS mode (None = off), off-policy threshold
    ("cispo", "token", 0.0, 5.0, None, None),
    ("cispo", "token", 0.04, 1.2, "token_truncate", 0.1),
    ("sapo", "token", 0.0, 0.2, None, None),
    ("sapo", "sequence", 0.04, 0.2, "sequence_mask", None),
    ("luspo", "sequence", 0.0, 0.28, None, None),
    ("luspo", "sequence", 0.04, 0.28, "sequence_truncate", 0.05),
    ("vespo", "token", 0.0, 0.2, None, None),
    ("vespo", "token", 0.04, 0.2, "token_mask", None),
    ("grpo", "sequence", 0.0, 0.28, None, None),  # GSPO
    ("grpo", "sequence", 0.04, 0.28, "token_mask", 0.1),
    ("dapo", "token", 0.0, 0.28, "token_truncate", None),
    ("dapo", "token", 0.04, 0.28, "sequence_mask", 0.05),
    ("bnpo", "token", 0.0, 0.2, "token_mask", None),
]


def _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    # Copied from trl 1.16.0 trl/trainer/grpo_trainer.py, _generate_and_score_completions,
    # `if self.use_vllm and self.vllm_importance_sampling_correction:` (no tool mask).
    import math

    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 1.3), (0.8, 1.25), (0.9, None)])
def test_rollout_correction_matches_trl(mode, clip_min, clip_max):
    from rlkit.grpo.correction import rollout_correction

    logp, old, _, _, mask, _ = _inputs(seed=3)
    sampling = old + 0.15 * torch.randn(B, T, generator=torch.Generator().manual_seed(4))
    sampling[2, 0] = float("nan")  # a token vLLM could not score: ratio 1, as in TRL
    if mode.startswith("sequence"):  # sequence log-ratios [0.4, -0.4, 0.05, 0]: ratios 1.49, 0.67, 1.05, 1
        per_token = torch.tensor([0.4, -0.4, 0.05, 0.0]) / mask.sum(-1)
        sampling = old - per_token[:, None] * mask
    want = _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max)
    got = rollout_correction(old, sampling, mask, mode, clip_min, clip_max)
    torch.testing.assert_close(got.weights, want, atol=1e-6, rtol=0)
    assert 0 < got.metrics["is/corrected_frac"] < 1  # the bounds bite on some, not all


@pytest.mark.parametrize("loss_type, level, beta, eps_high, is_mode, opm", NEW_CASES)
def test_new_losses_match_trl(loss_type, level, beta, eps_high, is_mode, opm):
    from rlkit.grpo.correction import off_policy_mask, rollout_correction
    from rlkit.grpo.loss import SoftGates

    logp, old, ref, adv, mask, ent = _inputs(seed=len(loss_type) + len(level))
    sampling = old + 0.1 * torch.randn(B, T, generator=torch.Generator().manual_seed(7))
    if is_mode and is_mode.startswith("sequence"):
        sampling = old + 0.03 * torch.randn(B, T, generator=torch.Generator().manual_seed(8))
    ga, procs, spg, num_items_gen = 2, 2, 2, torch.tensor(37.0)
    if opm is not None:
        sampling[1] += 0.3  # row 1 (A < 0) drifts from the sampler: the off-policy mask drops it
    is_ratio = None if is_mode is None else _trl_is_ratio(old, sampling, mask, is_mode, 0.5, 1.4)
    stub = _trl_stub(logp, ent, loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=eps_high, delta=None, ga=ga,
                     procs=procs, steps_per_gen=spg, max_len=8)
    gates = SoftGates(1.0, 1.05, 2.0, 3.0, 3.0, 2.0)
    stub.importance_sampling_level, stub.off_policy_mask_threshold = level, opm
    stub.use_vllm = stub.vllm_importance_sampling_correction = is_mode is not None
    stub.args.sapo_temperature_pos = gates.sapo_temperature_pos
    stub.args.sapo_temperature_neg = gates.sapo_temperature_neg
    stub.args.vespo_k_pos, stub.args.vespo_lambda_pos = gates.vespo_k_pos, gates.vespo_lambda_pos
    stub.args.vespo_k_neg, stub.args.vespo_lambda_neg = gates.vespo_k_neg, gates.vespo_lambda_neg
    stub.get_off_policy_mask, stub.get_gamma_weights = GRPOTrainer.get_off_policy_mask, GRPOTrainer.get_gamma_weights
    inputs = {"prompt_ids": torch.zeros(B, P_LEN, dtype=torch.long),
              "prompt_mask": torch.ones(B, P_LEN, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": num_items_gen,
              "sampling_per_token_logps": sampling}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    trl_loss = GRPOTrainer._compute_loss(stub, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)

    weights = None if is_mode is None else rollout_correction(old, sampling, mask, is_mode, 0.5, 1.4).weights
    keep = None if opm is None else off_policy_mask(adv, logp, sampling, mask, opm)
    out = policy_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=eps_high, ref_logp=ref, beta=beta,
                      loss_type=loss_type, importance_sampling_level=level, max_completion_length=8,
                      num_items_in_batch=num_items_gen / procs * ga / spg, entropies=ent, is_weights=weights,
                      keep=keep, gates=gates)
    ours = out.loss if loss_type in ("dapo", "cispo", "vespo") else out.loss / ga
    (our_grad,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, trl_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_grad, trl_grad, atol=1e-6, rtol=0)
    assert our_grad.abs().sum() > 0
    m = stub._metrics["train"]
    if loss_type == "cispo":
        assert out.clip_frac.item() == pytest.approx(m["cispo_clip_ratio"][0], abs=1e-6)
    elif loss_type == "vespo":
        assert out.phi_mean.item() == pytest.approx(m["vespo/phi_seq_mean"][0], abs=1e-6)
    elif loss_type != "sapo":
        assert out.clip_frac_low.item() == pytest.approx(m["clip_ratio/low_mean"][0], abs=1e-6)
        assert out.clip_frac.item() == pytest.approx(m["clip_ratio/region_mean"][0], abs=1e-6)
    if opm is not None:
        assert 0 < keep.sum() < B  # the off-policy mask drops some sequences, not all


def _trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    # Copied from trl 1.16.0 trl/trainer/grpo_trainer.py, _generate_and_score_completions,
    # `elif self.multi_objective_aggregation == "normalize_then_sum":` (+ the unscorable mask and nan_to_num).
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_normalize_then_sum_matches_trl(group_size):
    from rlkit.grpo.advantages import normalize_then_sum

    g = torch.Generator().manual_seed(group_size)
    per_fn = torch.stack([torch.randint(0, 2, (32,), generator=g).float(), torch.rand(32, generator=g)], dim=1)
    per_fn[3, 1] = float("nan")  # one function skipped a sample
    per_fn[9] = float("nan")  # every function skipped it: unscorable
    weights = torch.tensor([1.0, 0.5])
    want = _trl_normalize_then_sum(per_fn, weights, group_size)
    got = normalize_then_sum(per_fn, weights, group_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got[9] == 0
