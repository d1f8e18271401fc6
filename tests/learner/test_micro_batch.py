"""`MicroBatch`: the one batch type that crosses the Ray boundary into a learner. Read-only; the
logprobs a learner scores before its first update make a new batch, checked against its rows."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlkit.grpo.batch import GRPOBatch, Rollout
from rlkit.learner.objective import MicroBatch


def _grpo() -> GRPOBatch:
    rollouts = [Rollout([5, 6, 7], [8, 9], truncated=False, logprobs=[-1.0, -2.0]),
                Rollout([5, 6], [11, 12, 13], truncated=False, logprobs=[-0.3, -1.5, -2.0])]
    return GRPOBatch.collate(rollouts, torch.tensor([1.0, -1.0]), 0)


@pytest.mark.parametrize("packed", [False, True])
def test_the_stage_builds_one_and_the_learner_cannot_change_it(packed):
    batch = _grpo()
    mb = batch.packed_micro_batch([0, 1]) if packed else batch.micro_batch([0, 1])
    assert isinstance(mb, MicroBatch) and mb["completion_mask"].shape == (2, 5)
    with pytest.raises(TypeError):
        mb["old_logp"] = torch.zeros(2, 4)
    scored = mb.attach("old_logp", torch.zeros(2, 4))
    assert "old_logp" in scored and "old_logp" not in mb  # a new batch; the one sent is as it was
    back = pickle.loads(pickle.dumps(scored))  # what Ray does at the boundary
    assert isinstance(back, MicroBatch) and set(back) == set(scored)
    assert all(torch.equal(back[k], scored[k]) for k in scored if isinstance(scored[k], torch.Tensor))


def test_attach_takes_only_logprob_sources_that_fit_the_rows():
    mb = _grpo().micro_batch([0, 1])
    with pytest.raises(ValueError, match="does not fit a batch of"):
        mb.attach("ref_logp", torch.zeros(2, 5))  # one per shifted position: [B, L-1]
    with pytest.raises(ValueError, match="not a logprob source"):
        mb.attach("advantages", torch.zeros(2, 4))
    with pytest.raises(ValueError, match="already there"):
        mb.attach("ref_logp", torch.zeros(2, 4)).attach("ref_logp", torch.zeros(2, 4))
    with pytest.raises(ValueError, match="needs input_ids"):
        MicroBatch({"labels": torch.zeros(1, 2)})
