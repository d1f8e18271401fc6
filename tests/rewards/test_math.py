"""rewards.math: math-verify accuracy (hand-checked answers), also from a worker thread."""

import threading

from rewards.math import accuracy, parse_prediction

CASES = [  # (completion, gold, expected)
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("<think>2+2</think><answer>4</answer>", "4", 1.0),
    ("<think>hmm</think><answer>$\\frac{3}{4}$</answer>", "\\frac{3}{4}", 1.0),
    ("<answer>x = \\sqrt{2}</answer>", "\\sqrt{2}", 1.0),
    ("所以答案是 \\boxed{42}。", "42", 1.0),
    ("答案：3/4", "0.75", 1.0),
    ("结果是１２", "12", 1.0),
    ("答案是 12，不是 13", "12", 0.0),          # the last number counts
    ("The result is 7.", "$7$", 1.0),
    ("I think \\boxed{3} no wait \\boxed{5}", "5", 1.0),
    ("no answer here", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
    ("\\boxed{2}", "not math at all ∅∅", None),   # unparseable gold: not applicable
]


def test_accuracy_hand_checked():
    completions = [c for c, _, _ in CASES]
    gold = [g for _, g, _ in CASES]
    got = accuracy(completions, gold)
    assert got == [e for _, _, e in CASES], list(zip(completions, got))


def test_chat_completion():
    msgs = [[{"role": "assistant", "content": "最终答案 \\boxed{10}"}]]
    assert accuracy(msgs, ["10"]) == [1.0]


def test_works_off_the_main_thread():
    out = {}

    def run():
        out["v"] = accuracy(["\\boxed{\\frac{2}{4}}", "\\boxed{3}"], ["1/2", "4"])
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out["v"] == [1.0, 0.0]


def test_parse_prediction_prefers_answer_tag():
    assert str(parse_prediction("\\boxed{1} <answer>2</answer>")[0]) == "2"
