"""rewards.length: Kimi k1.5 length penalty, cosine-scaled accuracy and DAPO soft overlong
(hand-computed, and against TRL's own functions where TRL has them)."""

import math

import pytest

from rewards.length import cosine_scaled, length_penalty, soft_overlong


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


def test_length_penalty_is_none_where_accuracy_cannot_judge():
    # a gold math-verify cannot parse: not applicable (None), not "wrong"
    got = length_penalty(["p", "p", "q"], ["\\boxed{1}", "\\boxed{1} 很长很长", "\\boxed{2}"], ["∅∅", "∅∅", "2"],
                         [[0], [0, 0, 0], [0]])
    assert got == [None, None, 0.0]


def test_cosine_scaled_hand_computed():
    # max_len 10: lengths 0, 5, 10 -> cos 1, 0, -1; past max_len stays at the long end
    ids = [[0] * n for n in (0, 5, 10, 0, 5, 20)]
    completions = ["\\boxed{5}"] * 3 + ["\\boxed{6}"] * 3
    got = cosine_scaled(completions, ["5"] * 6, ids, max_len=10)
    assert got == pytest.approx([1.0, 0.75, 0.5, -1.0, -0.75, -0.5])
    # without ids, characters: "答案 \\boxed{5}" is 12 characters of max_len 24 -> cos(pi/2) = 0
    assert cosine_scaled(["答案 \\boxed{5}"], ["5"], None, max_len=24) == pytest.approx([0.75])
    assert cosine_scaled(["\\boxed{5}"], ["∅∅"], [[0]], max_len=10) == [None]
    with pytest.raises(ValueError, match="max_len"):
        cosine_scaled(["x"], ["1"], None, max_len=0)


def test_cosine_scaled_matches_trl():
    from trl.rewards import get_cosine_scaled_reward

    trl_fn = get_cosine_scaled_reward(max_len=16)
    chat = [[{"role": "assistant", "content": c}] for c in
            ("\\boxed{\\frac{1}{3}}", "\\boxed{\\frac{1}{2}}", "so \\boxed{0.5}", "\\boxed{7}")]
    gold = ["\\frac{1}{3}", "\\frac{1}{3}", "\\frac{1}{2}", "\\frac{1}{2}"]
    ids = [[0] * n for n in (3, 9, 16, 40)]
    ours = cosine_scaled(chat, gold, ids, max_len=16)
    assert ours == pytest.approx(trl_fn(chat, gold, completion_ids=ids))
    assert ours[0] == pytest.approx(0.5 + 0.25 * (1 + math.cos(3 / 16 * math.pi)))
