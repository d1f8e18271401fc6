"""Learner step metrics: sums per step, means over micro-batches, then over steps and ranks."""

import pytest

from rlkit.learner.objective import StepMetrics, mean_metrics


def test_mean_metrics_averages_micro_batches_then_steps_and_ranks():
    # 2 ranks x 2 optimizer steps, 4 micro-batches each: per-step means 1, 2 (rank 0) and 3, 4 (rank 1).
    steps = [StepMetrics({"loss": 4.0 * m, "kl_mean": 0.4}, 4, grad_norm=g, lr=1e-3)
             for m, g in ((1, 0.5), (2, 1.5), (3, 0.5), (4, 1.5))]
    out = mean_metrics(steps)
    assert out["loss"] == pytest.approx(2.5) and out["kl_mean"] == pytest.approx(0.1)
    assert out["grad_norm"] == pytest.approx(1.0) and out["lr"] == pytest.approx(1e-3)
    assert mean_metrics([]) == {}
    assert steps[1].mean("loss") == 2.0
