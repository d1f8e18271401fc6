"""rewards.repetition: n-gram repetition penalty over words, CJK characters and tokens
(hand-computed, and against TRL's token version)."""

import pytest

from rewards.repetition import repetition_penalty, units


def test_english_words():
    # 6 words -> 4 trigrams: (the cat the) (cat the cat) x2 each -> 2 distinct -> 1 - 2/4
    assert repetition_penalty(["the cat the cat the cat", "The Cat sat on a mat"]) == [-0.5, 0.0]
    assert repetition_penalty(["a a"], ngram_size=3) == [0.0]      # shorter than n
    assert repetition_penalty([""]) == [0.0]
    assert repetition_penalty(["the cat the cat the cat"], max_penalty=-0.2) == [pytest.approx(-0.1)]


def test_chinese_counts_characters():
    # 9 characters -> 7 trigrams, 3 distinct (我很好, 很好我, 好我很) -> -(1 - 3/7)
    assert repetition_penalty(["我很好我很好我很好"]) == [pytest.approx(-4 / 7)]
    # open-r1's English (word) mode sees one word and no repeat at all
    assert repetition_penalty(["我很好我很好我很好"], unit="word") == [0.0]
    # mixed: 我 / love / 你 x2 -> 4 trigrams, 3 distinct -> -0.25
    assert units("我 love 你 我 LOVE 你", "auto") == ["我", "love", "你", "我", "love", "你"]
    assert repetition_penalty(["我 love 你 我 LOVE 你"]) == [pytest.approx(-0.25)]
    # char: every non-space character; bigrams of ababab: ab ba ab ba ab -> 2 of 5 distinct
    assert repetition_penalty(["ab ab ab"], ngram_size=2, unit="char") == [pytest.approx(-0.6)]
    # chat completions: 重复 复重 重复 复重 重复 -> 2 of 5 distinct
    assert repetition_penalty([[{"role": "assistant", "content": "重复重复重复"}]], ngram_size=2) == \
        [pytest.approx(-(1 - 2 / 5))]


def test_tokens_match_trl():
    from trl.rewards import get_repetition_penalty_reward

    ids = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2, 1, 2, 7]]
    ours = repetition_penalty(["x"] * 3, ids, ngram_size=2, unit="token")
    assert ours == pytest.approx(get_repetition_penalty_reward(2, -1.0)(completion_ids=ids))
    assert ours[:2] == [0.0, -0.75]


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_penalty"):
        repetition_penalty(["x"], max_penalty=1.0)
    with pytest.raises(ValueError, match="unit"):
        repetition_penalty(["x"], unit="line")
    with pytest.raises(ValueError, match="completion_ids"):
        repetition_penalty(["x"], unit="token")
    with pytest.raises(ValueError, match="ngram_size"):
        repetition_penalty(["x"], ngram_size=0)
