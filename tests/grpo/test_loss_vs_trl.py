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

from rlkit.grpo.advantages import group_advantages  # noqa: E402
from rlkit.grpo.loss import policy_loss, soft_overlong_penalty  # noqa: E402

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


def _trl_stub(logp, ent, *, loss_type, beta, eps_low, eps_high, delta, ga, procs, steps_per_gen, max_len):
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
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=steps_per_gen),
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
