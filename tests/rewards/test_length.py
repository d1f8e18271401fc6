"""rewards.length: Kimi k1.5 length penalty and DAPO soft overlong (hand-computed)."""

import pytest

from rewards.length import length_penalty, soft_overlong


def test_soft_overlong_dapo():
    # max_len 10, buffer 4: start = 6; len 6 -> 0, 7 -> -0.25, 8 -> -0.5, 10 -> -1, 11 -> -1
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    assert soft_overlong(["x"] * 6, ids, max_len=10, buffer_len=4) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert soft_overlong(["x"], [[0] * 8], max_len=10, buffer_len=4, penalty=0.5) == [-0.25]


def test_soft_overlong_needs_ids_and_sane_buffer():
    with pytest.raises(ValueError, match="completion_ids"):
        soft_overlong(["x"], None, max_len=10, buffer_len=4)
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong(["x"], [[1]], max_len=4, buffer_len=10)


def test_length_penalty_kimi_per_group():
    # group A (same prompt): lengths 2, 4, 6 (ids); lam = 0.5, 0, -0.5
    # correct, wrong, wrong -> 0.5, min(0, 0) = 0, -0.5
    # group B: one sample -> all lengths equal -> 0
    prompts = ["求 1+1", "求 1+1", "求 1+1", "other"]
    completions = ["\\boxed{2}", "\\boxed{3}", "\\boxed{5}", "\\boxed{9}"]
    answer = ["2", "2", "2", "9"]
    ids = [[0] * 2, [0] * 4, [0] * 6, [0] * 9]
    assert length_penalty(prompts, completions, answer, completion_ids=ids) == [0.5, 0.0, -0.5, 0.0]
    # long correct answer: lam negative even though correct
    assert length_penalty(["p", "p"], ["\\boxed{2}", "\\boxed{2}"], ["2", "2"], [[0], [0, 0, 0]]) == [0.5, -0.5]


def test_length_penalty_counts_characters_without_ids():
    # chat prompts group by content; lengths 4 ("答案:1") vs 8 chars
    p = [[{"role": "user", "content": "题"}]] * 2
    c = ["答案 1", "答案是 1 吧吧"]
    assert length_penalty(p, c, ["1", "1"]) == [0.5, -0.5]
