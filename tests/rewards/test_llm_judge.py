"""rewards.llm_judge: what a reply scores, what the template may name, what its engines ask of
Ray. The judge's real engines score a GRPO run in tests/e2e/test_rm.py."""

import pytest

from rewards.llm_judge import LLMJudge, parse_score
from rlkit.errors import DataError
from rlkit.reward import RewardScorer, RewardSpec
from rlkit.reward.contract import declared_range

VERDICTS = {"correct": 1.0, "Incorrect": 0.0, "partly correct": 0.5}


@pytest.mark.parametrize("reply, score", [
    ("Correct.", 1.0),
    ("The answer is incorrect", 0.0),             # a whole word: "incorrect" holds no "correct"
    ("At first correct... no: INCORRECT", 0.0),   # the last verdict word counts, any case
    ("It is partly correct", 0.5),                # the longer verdict wins where they overlap
    ("correctly formatted", None),                # not a whole word
    ("no verdict here", None),
])
def test_a_verdict_is_the_last_of_its_words(reply, score):
    assert parse_score(reply, VERDICTS, (0, 10)) == score


@pytest.mark.parametrize("reply, score", [
    ("7", 0.7), ("Score: 10/10", 1.0), ("I give it 2.5 out of 10", 0.25),
    ("42, no, 3", 0.3),                           # the first number inside the scale
    ("-1", None), ("eleven", None), ("", None),
])
def test_a_score_is_the_first_number_inside_the_scale(reply, score):
    assert parse_score(reply, None, (0, 10)) == score


def test_the_template_is_filled_from_the_sample_and_its_row():
    judge = LLMJudge("unused", template="Q: {prompt}\nA: {completion}\nRef: {answer}")
    chat = [{"role": "user", "content": "1+1="}]
    assert judge.questions([chat, "2+2="], [[{"role": "assistant", "content": "2"}], "5"], {"answer": ["2", "4"]}) == [
        "Q: 1+1=\nA: 2\nRef: 2", "Q: 2+2=\nA: 5\nRef: 4"]


def test_bad_arguments_and_rows_are_one_line():
    with pytest.raises(ValueError, match="names neither {prompt} nor {completion}"):
        LLMJudge("unused", template="Is {answer} right?")
    with pytest.raises(ValueError, match=r"scale: expected \[low, high\] with low < high, got \[5, 5\]"):
        LLMJudge("unused", scale=[5, 5])
    scorer = RewardScorer([RewardSpec(fn="rewards.llm_judge:LLMJudge",
                                      args={"path": "unused", "template": "{completion} vs {solution}"})])
    with pytest.raises(DataError, match=r"^train.jsonl: row 2: rewards\[0\] \(LLMJudge\) cannot judge it: its template "
                                        r"names \{solution\}, which the row does not have \(columns: answer, prompt\)"):
        scorer.check_rows("train.jsonl", [{"prompt": "a", "answer": "1", "solution": "x"},
                                          {"prompt": "b", "answer": "2"}])


def test_its_range_and_its_engines_bundles():
    assert declared_range(LLMJudge, {}) == (0.0, 1.0)
    assert declared_range(LLMJudge, {"verdicts": {"yes": 2.0, "no": -1.0}, "unparseable": -2.0}) == (-2.0, 2.0)
    judge = LLMJudge("unused", engines=2, device="npu", devices=2, num_cpus=4, resources={"judge": 1})
    assert judge.ray_resources() == [{"CPU": 4.0, "NPU": 2.0, "judge": 1.0}] * 2
    assert LLMJudge("unused", ray_actor=False).ray_resources() is None
    scorer = RewardScorer([RewardSpec(fn="rewards.llm_judge:LLMJudge", args={"path": "unused", "engines": 2})])
    assert scorer.actor_bundles() == [("rewards[0]", {"CPU": 1.0})] * 2
