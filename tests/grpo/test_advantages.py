"""rlkit.grpo.advantages against hand-computed values (TRL comparison: test_loss_vs_trl.py)."""

import math

import pytest
import torch

from rlkit.grpo.advantages import (
    ADVANTAGES,
    frac_zero_std,
    get_advantage,
    group_advantages,
    register_advantage,
    zero_std_mask,
)

EPS = 1e-4


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_two_groups_of_two_sample_std():
    # groups [1,0] and [0,1]: mean 0.5, deviations +-0.5
    # sample var = (0.25 + 0.25) / (2 - 1) = 0.5 -> std = sqrt(0.5) = 0.70711
    # adv = +-0.5 / (0.70711 + 1e-4) = +-0.70700
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(group_advantages(t(1, 0, 0, 1), 2), t(a, -a, -a, a))
    assert a == pytest.approx(0.707006, abs=1e-6)


def test_two_groups_of_two_population_std():
    # population var = (0.25 + 0.25) / 2 = 0.25 -> std 0.5; adv = 0.5 / 0.5001 = 0.99980
    a = 0.5 / (0.5 + EPS)
    out = group_advantages(t(1, 0, 0, 1), 2, std="population")
    torch.testing.assert_close(out, t(a, -a, -a, a))


def test_group_of_four_sample_std():
    # [1,2,3,4]: mean 2.5, deviations [-1.5,-0.5,0.5,1.5], sum sq = 5
    # sample var = 5/3 = 1.6667 -> std = 1.290994; population std = sqrt(5/4) = 1.118034
    std = math.sqrt(5 / 3)
    assert std == pytest.approx(1.2910, abs=1e-4)
    expected = t(-1.5, -0.5, 0.5, 1.5) / (std + EPS)
    torch.testing.assert_close(group_advantages(t(1, 2, 3, 4), 4), expected)
    expected_pop = t(-1.5, -0.5, 0.5, 1.5) / (math.sqrt(1.25) + EPS)
    torch.testing.assert_close(group_advantages(t(1, 2, 3, 4), 4, std="population"), expected_pop)


def test_zero_std_group_gets_zero_advantage():
    # group [2,2]: deviations 0 -> 0 / (0 + 1e-4) = 0; group [0,1] as above
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(group_advantages(t(2, 2, 0, 1), 2), t(0, 0, -a, a))


def test_dr_grpo_only_centres():
    # [1,0,0,0]: mean 0.25 -> [0.75,-0.25,-0.25,-0.25]; [3,3,3,3] -> 0
    out = group_advantages(t(1, 0, 0, 0, 3, 3, 3, 3), 4, scale="none")
    torch.testing.assert_close(out, t(0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0))


def test_batch_scale_uses_group_mean_and_batch_std():
    # group means 0.25 and 1; batch = three 0s, five 1s, mean 0.625
    # sample var = (3*0.625^2 + 5*0.375^2) / 7 = 1.875 / 7 -> std 0.517549
    std = math.sqrt(1.875 / 7)
    out = group_advantages(t(1, 0, 0, 0, 1, 1, 1, 1), 4, scale="batch")
    torch.testing.assert_close(out, t(0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0) / (std + EPS))


def test_nan_reward_is_excluded_and_gets_zero():
    # [1, nan, 0]: stats over [1, 0] -> mean 0.5, sample std 0.70711; the NaN gets 0
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(group_advantages(t(1, float("nan"), 0), 3), t(a, 0, -a))


def test_group_size_one_is_zero():
    torch.testing.assert_close(group_advantages(t(1, 5), 1), t(0, 0))


def test_custom_eps():
    torch.testing.assert_close(group_advantages(t(0, 2), 2, eps=0.5), t(-1, 1) / (math.sqrt(2) + 0.5))


@pytest.mark.parametrize("fn", [group_advantages, zero_std_mask])
def test_not_divisible_names_both(fn):
    with pytest.raises(ValueError, match=r"N=5.*G=2"):
        fn(torch.zeros(5), 2)


def test_bad_options():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="groupp")
    with pytest.raises(ValueError, match="std"):
        group_advantages(torch.zeros(4), 2, std="unbiased")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_zero_std_mask():
    r = t(1, 1, 0, 1, 3, 3, 0.5, float("nan"))
    # groups: [1,1] flat, [0,1] varied, [3,3] flat, [0.5,nan] one valid value -> flat
    assert zero_std_mask(r, 2).tolist() == [True, False, True, True]
    assert frac_zero_std(r, 2) == pytest.approx(0.75)
    assert zero_std_mask(t(1.0, 1.05), 2, atol=0.1).tolist() == [True]


def test_registry():
    assert {"grpo", "no_std", "batch_std"} <= set(ADVANTAGES)
    r = t(1, 2, 3, 4, 0, 0, 1, 1)
    torch.testing.assert_close(get_advantage("grpo")(r, 4), group_advantages(r, 4))
    torch.testing.assert_close(get_advantage("no_std")(r, 4), group_advantages(r, 4, scale="none"))
    batch_pop = group_advantages(r, 4, "batch", std="population")
    torch.testing.assert_close(get_advantage("batch_std")(r, 4, std="population"), batch_pop)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda rewards, group_size, **kw: rewards)
    with pytest.raises(ValueError, match="valid"):
        get_advantage("nope")


# --- rloo, REINFORCE++, GDPO (TRL comparison for GDPO: test_loss_vs_trl.py) ----------------------


def test_rloo_by_hand():
    from rlkit.grpo.advantages import get_advantage

    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, float("nan")])  # groups of 3
    adv = get_advantage("rloo")(r, 3)
    # group 0: 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5 (twice); group 1 (valid 1, 2): 1 - 2 = -1, 2 - 1 = 1, NaN -> 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -1.0, 1.0, 0.0]))


def test_reinforce_pp_whitens_over_the_batch():
    from rlkit.grpo.advantages import get_advantage

    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # mean 0.25, sample std 0.5
    torch.testing.assert_close(get_advantage("reinforce_pp")(r, 2, eps=0.0), torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # baseline: group-centred [0.5, -0.5, 0, 0] (mean 0, sample std sqrt(1/6)) then whitened
    c = torch.tensor([0.5, -0.5, 0.0, 0.0])
    torch.testing.assert_close(get_advantage("reinforce_pp_baseline")(r, 2, eps=0.0), c / math.sqrt(1 / 6))


def test_dr_grpo_is_the_unscaled_estimator():
    from rlkit.grpo.advantages import get_advantage

    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    torch.testing.assert_close(get_advantage("dr_grpo")(r, 2), torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_normalize_then_sum_by_hand():
    from rlkit.grpo.advantages import normalize_then_sum

    # two groups of 2, two functions: per group each column normalises to +-1/sqrt(2) (sample std sqrt(2)/2)
    per_fn = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    s = 1 / math.sqrt(2)
    summed = torch.tensor([s - 0.5 * s, -s + 0.5 * s, s + 0.5 * s, -s - 0.5 * s])  # weights [1, 0.5]
    want = (summed - summed.mean()) / summed.std()
    torch.testing.assert_close(normalize_then_sum(per_fn, torch.tensor([1.0, 0.5]), 2, eps=0.0), want)
