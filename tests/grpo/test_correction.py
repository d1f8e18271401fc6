"""Rollout correction and the mismatch metrics, by hand (TRL comparison: test_loss_vs_trl.py)."""

import math

import pytest
import torch

from rlkit.grpo.correction import MISMATCH_METRICS, off_policy_mask, rollout_correction

D = torch.float64


def two_rows():
    """learner - engine per token: row 0 [ln 3, 0, -ln 2], row 1 [ln 1.5, ln 1.5, (masked) 5]."""
    diff = torch.tensor([[math.log(3), 0.0, -math.log(2)], [math.log(1.5), math.log(1.5), 5.0]], dtype=D)
    engine = torch.full_like(diff, -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    return engine + diff, engine, mask


@pytest.mark.parametrize("mode, clip, weights", [
    ("token_truncate", (None, 2.0), [[2.0, 1.0, 0.5], [1.5, 1.5, 1.0]]),
    ("token_truncate", (0.8, 2.0), [[2.0, 1.0, 0.8], [1.5, 1.5, 1.0]]),
    ("token_mask", (0.8, 2.0), [[0.0, 1.0, 0.0], [1.5, 1.5, 1.0]]),  # ICEPOP: both bounds mask
    # sequence ratios: row 0 3 * 1 * 0.5 = 1.5, row 1 1.5 * 1.5 = 2.25 (the masked token does not count)
    ("sequence_truncate", (None, 2.0), [[1.5], [2.0]]),
    ("sequence_mask", (None, 2.0), [[1.5], [0.0]]),
])
def test_weights_by_hand(mode, clip, weights):
    learner, engine, mask = two_rows()
    out = rollout_correction(learner, engine, mask, mode, *clip)
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=D))
    changed = {"token_truncate": 2 / 5 if clip[0] else 1 / 5, "token_mask": 2 / 5, "sequence_truncate": 1 / 2,
               "sequence_mask": 1 / 2}[mode]
    assert out.metrics["is/corrected_frac"].item() == pytest.approx(changed)


def test_metrics_by_hand():
    learner, engine, mask = two_rows()
    m = rollout_correction(learner, engine, mask, "none").metrics
    assert set(m) == set(MISMATCH_METRICS)
    d = [math.log(3), 0.0, -math.log(2), math.log(1.5), math.log(1.5)]
    assert m["mismatch/logp_abs_diff_mean"].item() == pytest.approx(sum(abs(x) for x in d) / 5)
    assert m["mismatch/logp_abs_diff_max"].item() == pytest.approx(math.log(3))  # the masked 5.0 does not count
    assert m["mismatch/kl"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5)
    assert m["is/ratio_mean"].item() == pytest.approx((3 + 1 + 0.5 + 1.5 + 1.5) / 5)
    assert m["is/ratio_min"].item() == pytest.approx(0.5) and m["is/ratio_max"].item() == pytest.approx(3.0)
    assert m["is/corrected_frac"].item() == 0


def test_identical_logprobs_give_zero_mismatch_and_unit_weights():
    learner = -torch.rand(3, 5, dtype=D)
    mask = torch.ones(3, 5, dtype=D)
    out = rollout_correction(learner, learner.clone(), mask, "sequence_mask", 0.5, 2.0)
    assert out.metrics["mismatch/kl"].item() == 0 and out.metrics["mismatch/logp_abs_diff_max"].item() == 0
    assert (out.weights == 1).all()


def test_bad_mode_is_refused():
    learner, engine, mask = two_rows()
    with pytest.raises(ValueError, match="rollout correction mode must be one of"):
        rollout_correction(learner, engine, mask, "sequence")


def test_off_policy_mask_drops_only_negative_advantage_sequences_that_drifted():
    logp = torch.zeros(3, 2, dtype=D)
    engine = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.05, 0.05]], dtype=D)  # mean KL 0.5, 0.5, 0.05
    keep = off_policy_mask(torch.tensor([1.0, -1.0, -1.0]), logp, engine, torch.ones(3, 2), threshold=0.1)
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0]
