"""ZeRO-3 learners whose micro-batches score different numbers of positions: the lm_head is
projected chunk by chunk (`token_logprobs`), and each call of a partitioned head gathers its
weight with the other ranks, so every rank must make as many calls (a real model's vocabulary
makes chunks of a few hundred positions; rank 0 here scores 20 chunks, rank 1 three). Before,
gloo aborted the learners ("Received data size doesn't match expected size")."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from rlkit.learner.logprobs import token_logprobs
from tests.sides import vocab_size

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class ChunkedNLL:
    """SFT's token-mean NLL with the lm_head projected `chunk_elements // vocab` positions at a time."""

    chunk_elements: int
    temperature: float = 1.0
    needs: tuple[str, ...] = ()

    def positions(self, batch):
        return batch["labels"][:, 1:] != -100

    def __call__(self, model, batch):
        where = self.positions(batch)
        logp, _ = token_logprobs(model, batch, positions=where, chunk_elements=self.chunk_elements)
        return -logp.sum() / where.sum().clamp(min=1), {"tokens": where.sum()}


def test_zero3_ranks_with_different_chunk_counts_train_as_with_one_chunk(ray_local, tiny_models):
    from ray import cloudpickle

    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the objective above, to the actors
    model_dir = tiny_models["tiny"]
    vocab = vocab_size(model_dir)
    spec = LearnerSpec(ModelConfig(path=str(model_dir)), "full", None, None,
                       OptimConfig(lr=1e-12, scheduler="constant"), DeepSpeedConfig(zero_stage=3, dist_timeout_s=60),
                       micro_batch_size=2, grad_accum=2, total_steps=10, seed=0, device="cpu")
    group = LearnerGroup(spec, 2, detect("cpu"), RayConfig())
    gen = torch.Generator().manual_seed(0)

    def rows(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(4, vocab, (2, length), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    batches = [[rows(41), rows(30)], [rows(7), rows(5)]]  # rank 0: ~20 chunks of 4 positions, rank 1: ~3
    try:
        small = group.train_step(batches, ChunkedNLL(4 * vocab))
        whole = group.train_step(batches, ChunkedNLL(2**26))  # one chunk each; lr 1e-12: the same weights
        assert [s.micro_batches for s in small] == [2, 2]
        assert small[0].grad_norm == pytest.approx(whole[0].grad_norm, rel=1e-5)
        assert small[0].sums["tokens"] == whole[0].sums["tokens"]
    finally:
        group.shutdown()
