"""rewards.math: math-verify accuracy (hand-checked answers), also from a worker thread."""

import threading

import pytest

from rewards.math import accuracy, is_text_gold, parse_prediction

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
    ("\\boxed{2}", "∅∅", None),                    # unparseable gold: not applicable
    ("\\boxed{2}", "", None),                      # no gold
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


def test_words_are_text_not_algebra():
    # a word gold would parse as a product of one-letter symbols: anagrams matched and
    # "forty two" scored 0.0; it is compared as text (case, \\text{}, spaces, punctuation aside)
    cases = [
        ("\\boxed{two forty}", "forty two", 0.0),
        ("\\boxed{Forty  Two}", "forty two", 1.0),
        ("\\boxed{sirap}", "Paris", 0.0),
        ("<answer>paris.</answer>", "Paris", 1.0),
        ("\\boxed{\\text{Paris}}", "Paris", 1.0),
        ("The capital is Paris", "Paris", 0.0),        # no final answer marked: nothing to compare
        ("答案是 \\boxed{巴黎}", "巴黎", 1.0),
        ("答案是 \\boxed{黎巴}", "巴黎", 0.0),
        ("\\boxed{42}", "forty two", 0.0),
        ("\\boxed{\\sin(x)}", "\\sin x", 1.0),        # function names stay math
        ("\\boxed{yx+1}", "xy + 1", 1.0),              # so do products of variables
        ("\\boxed{5}", "5\\text{ cm}", 1.0),           # a unit after a number stays math
    ]
    got = accuracy([c for c, _, _ in cases], [g for _, g, _ in cases])
    assert got == [e for _, _, e in cases], list(zip(cases, got))
    assert [is_text_gold(g) for g in ("Paris", "巴黎", "\\text{Monday}", "x^2+1", "\\frac{1}{2}", "\\sqrt{3}",
                                      "5\\text{ cm}", "2xy")] == [True, True, True, False, False, False, False, False]


def test_reasoning_delimiters_score_only_the_final_answer():
    completions = [
        "<think>2+2 is \\boxed{4}</think> so \\boxed{4}",   # answer after the reasoning
        "<think>maybe \\boxed{4}</think> I am not sure",     # answer only inside the reasoning
        "<think>maybe \\boxed{4}",                           # truncated: reasoning never ended
        "\\boxed{4}",                                        # no reasoning block at all
        [{"role": "assistant", "content": "<think>想想</think>答案 \\boxed{4}"}],
    ]
    gold = ["4"] * 5
    assert accuracy(completions, gold) == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert accuracy(completions, gold, reasoning_delimiters=["</think>"]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="list of non-empty strings"):
        accuracy(completions, gold, reasoning_delimiters="</think>")


def test_agrees_with_trl_reasoning_accuracy_reward():
    from trl.rewards import reasoning_accuracy_reward

    contents = ["<think>\\boxed{\\frac{1}{3}}</think> The answer is \\boxed{\\frac{1}{3}}",
                "<think>\\boxed{\\frac{1}{3}}</think> The answer is \\boxed{\\frac{1}{2}}",
                "<think>partial \\boxed{\\frac{1}{3}} but no end"]
    chat = [[{"role": "assistant", "content": c}] for c in contents]
    gold = ["\\frac{1}{3}"] * 3
    assert accuracy(chat, gold, reasoning_delimiters=["</think>"]) == reasoning_accuracy_reward(chat, gold)


def test_gsm8k_hash_line_is_the_final_answer():
    cases = [  # (completion, gold, expected)
        ("3 + 4 = 7 apples\n#### 7", "7", 1.0),
        ("She pays 1,000 + 200 = 1,200\n#### $1,200", "1200", 1.0),
        ("Half of it is 50%\n#### 50%", "50", 1.0),
        ("So he buys 5, not 6\n#### 6", "5", 0.0),        # the #### line, not the last number before it
        ("#### 4\nno wait, 5 in the end", "4", 1.0),       # the last #### line counts, text after it aside
        ("#### 3\n#### 8", "8", 1.0),                      # the last of several
        ("\\boxed{9}\n#### 2", "9", 1.0),                  # a box still wins
        ("It costs 12 dollars.\n####", "12", 1.0),         # an empty #### line: the whole completion, as before
        ("It is 2.50 each\n#### 2.5", "2.5", 1.0),
        ("x ####5", "5", 1.0),                             # not at a line start: the last number
    ]
    got = accuracy([c for c, _, _ in cases], [g for _, g, _ in cases])
    assert got == [e for _, _, e in cases], list(zip(cases, got))


def test_solution_values_credits_the_reference_results():
    from rewards.math import solution_values

    ref = "He got $0.05 back because $5*1/100 = 0.05\nHe spent 5 - 0.05 = 4.95\nchips: 3*0.4 = $1.20\n#### 5"
    completions = [
        "5*1/100 = 0.05, then 5-0.05=$4.95\n#### 5",   # 3 of 4: 0.05, 4.95, 5
        "3 * 0.4 = 1.2\n#### 7",                        # 1.2 == 1.20
        "0.05 4.95 1.2 5",                              # numbers without '=': not computed results
        "5 - 0.05 = 4.95 = 4.95\n#### 4.95",            # a value counts once
        "",
    ]
    assert solution_values(completions, [ref] * 5) == [0.75, 0.25, 0.0, 0.25, 0.0]
    assert solution_values(["#### 3"], ["no equation, no answer line"]) == [None]
    assert solution_values(["1,200 = 1,200"], ["a = 1,200\n#### 1200"]) == [1.0]
