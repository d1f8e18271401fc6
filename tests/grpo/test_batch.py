"""Rollouts -> learner tensors: padding, completion masks, micro-batch plans, learner shards (hand-checked)."""

import torch

from rlkit.grpo.batch import GRPOBatch, Rollout, plan_micro_batches


def test_collate_masks_completion_and_truncated():
    rs = [Rollout([1, 2], [3, 4, 0], False), Rollout([5], [6], True)]
    b = GRPOBatch.collate(rs, torch.tensor([0.5, -0.5]), pad_id=9, mask_truncated=True)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 0], [5, 6, 9, 9, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]  # truncated: no loss
    b2 = GRPOBatch.collate(rs, torch.tensor([0.5, -0.5]), pad_id=9)
    assert b2.completion_mask[1].tolist() == [0, 1, 0, 0, 0]
    assert b2.completion_tokens() == 4  # shifted space: positions 1..L-1


def test_micro_batch_trims_padding():
    rs = [Rollout([1, 2], [3, 4, 5], False), Rollout([5], [6], False)]
    b = GRPOBatch.collate(rs, torch.tensor([1.0, 2.0]), pad_id=0)
    s = b.micro_batch([1])
    assert s["input_ids"].tolist() == [[5, 6]] and s["advantages"].tolist() == [2.0]


def test_plan_covers_every_row_once_in_equal_shares():
    plan = plan_micro_batches(32, mini_batches=2, world=2, micro=4, seed=0)
    assert len(plan) == 2 and all(len(m) == 2 for m in plan)
    assert all(len(mb) == 4 for m in plan for rank in m for mb in rank)
    flat = sorted(i for m in plan for rank in m for mb in rank for i in mb)
    assert flat == list(range(32))
    assert plan == plan_micro_batches(32, 2, 2, 4, seed=0) != plan_micro_batches(32, 2, 2, 4, seed=1)


def test_collate_places_engine_logprobs_in_shifted_space():
    # Prompt [1, 2], completion [3, 4]: token 3 is scored at shifted position 1 (logits of
    # position 1), token 4 at position 2.
    rs = [Rollout([1, 2], [3, 4], False, [-0.5, -1.5]), Rollout([5], [6], False, [-2.0])]
    b = GRPOBatch.collate(rs, torch.tensor([1.0, -1.0]), pad_id=0)
    assert b.engine_logp.tolist() == [[0.0, -0.5, -1.5], [-2.0, 0.0, 0.0]]
    mask = b.completion_mask[:, 1:]
    assert (b.engine_logp != 0).eq(mask.bool()).all()
    s = b.micro_batch([1])
    assert s["engine_logp"].tolist() == [[-2.0]] and s["input_ids"].tolist() == [[5, 6]]
    assert "old_logp" not in s  # the learner's own, attached by the learner when a batch is reused
    # rollouts without engine logprobs (not from vLLM): no engine_logp, no correction
    assert GRPOBatch.collate([Rollout([1], [2], False)], torch.tensor([0.0]), pad_id=0).engine_logp is None


def test_shards_give_each_rank_its_steps_and_the_step_normaliser():
    """2 mini-batches x 2 ranks x 2 micro-batches of 1 row: rank r gets its micro-batches of each
    step, and every micro-batch of a step carries tokens(step, all ranks) / (world * grad_accum)."""
    rs = [Rollout([1], [2] * (i + 1), False) for i in range(8)]  # row i has i + 1 loss tokens
    b = GRPOBatch.collate(rs, torch.arange(8, dtype=torch.float32), pad_id=0)
    plan = [[[[0], [1]], [[2], [3]]], [[[4], [5]], [[6], [7]]]]
    shards = b.shards(plan)
    assert len(shards) == 2 and all(len(steps) == 2 and all(len(s) == 2 for s in steps) for steps in shards)
    assert [mb["advantages"].item() for mb in shards[1][0]] == [2.0, 3.0]
    assert [mb["advantages"].item() for mb in shards[0][1]] == [4.0, 5.0]
    # step 0: rows 0-3 hold 1+2+3+4 = 10 tokens -> 10 / (2 ranks * 2 micro-batches); step 1: 5+6+7+8 = 26
    assert [float(mb["num_items_in_batch"]) for rank in shards for mb in rank[0]] == [2.5] * 4
    assert [float(mb["num_items_in_batch"]) for rank in shards for mb in rank[1]] == [6.5] * 4


def test_token_plan_packs_within_the_budget_and_gives_every_rank_as_many_micro_batches():
    import random

    from rlkit.grpo.batch import plan_token_micro_batches

    rng = random.Random(0)
    lengths = [rng.randint(10, 120) for _ in range(64)]
    plan = plan_token_micro_batches(lengths, mini_batches=2, world=2, budget=200, seed=3)
    assert len(plan) == 2 and all(len(m) == 2 for m in plan)
    assert sorted(i for m in plan for rank in m for mb in rank for i in mb) == list(range(64))
    for m in plan:
        assert len(m[0]) == len(m[1]) > 64 * 65 // 2 // 200 // 4  # the same count on both ranks, and packed
        assert all(sum(len(mb) for mb in rank) == 16 for rank in m)  # each rank's share of the mini-batch
        assert all(mb and sum(lengths[i] for i in mb) <= 200 for rank in m for mb in rank)
    assert plan == plan_token_micro_batches(lengths, 2, 2, 200, seed=3)
    # a rank with one long row and short ones splits its micro-batches to match the rank that needs more
    uneven = plan_token_micro_batches([100, 100, 100, 100, 10, 10, 10, 10], 1, 2, 200, seed=0)
    assert len(uneven[0][0]) == len(uneven[0][1])


def test_packed_micro_batch_holds_the_rows_back_to_back_and_how_to_unpack_them():
    rs = [Rollout([1, 2], [3, 4, 5], False, [-1.0, -2.0, -3.0]), Rollout([6], [7], False, [-4.0])]
    b = GRPOBatch.collate(rs, torch.tensor([1.0, 2.0]), pad_id=0)
    padded, packed = b.micro_batch([0, 1]), b.packed_micro_batch([0, 1])
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed["unpack"].tolist() == [[0, 1, 2, 3, 4], [5, 6, -1, -1, -1]]
    assert "attention_mask" not in packed
    for key in ("completion_mask", "advantages", "engine_logp"):  # the loss's layout stays padded
        assert torch.equal(packed[key], padded[key]), key
    shards = b.shards([[[[0, 1]]]], packed=True)
    assert shards[0][0][0]["input_ids"].shape == (1, 7) and float(shards[0][0][0]["num_items_in_batch"]) == 4.0
