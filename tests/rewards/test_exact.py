"""rewards.exact: normalised string match and number match (hand-computed)."""

from fractions import Fraction

from rewards.exact import exact_match, normalize_text, number_match, parse_number


def test_normalize_text():
    assert normalize_text("  Hello   World. ") == "hello world"
    assert normalize_text("北京。") == "北京"
    assert normalize_text("ＡＢＣ　１２３！") == "abc 123"   # full-width letters, space, digits, "！"


def test_exact_match_normalised_and_raw():
    completions = ["Paris.", "  北京。", "１９", "london", "Rome"]
    answer = ["paris", "北京", "19", ["London", "Londres"], None]
    assert exact_match(completions, answer) == [1.0, 1.0, 1.0, 1.0, None]
    assert exact_match(completions, answer, normalize=False) == [0.0, 0.0, 0.0, 0.0, None]


def test_exact_match_chat_completions():
    c = [[{"role": "assistant", "content": "答案是五"}]]
    assert exact_match(c, ["答案是五"]) == [1.0]


def test_parse_number():
    assert parse_number("19") == 19
    assert parse_number("答案：－３") == -3
    assert parse_number("about 1,000 apples, 2.5 kg") == 1000
    assert parse_number("2.50 then 7", "last") == 7
    assert parse_number("3/4 of it") == Fraction(3, 4)
    assert parse_number("no digits") is None
    assert parse_number("x2 is not a number; 5 is") == 5


def test_number_match_arithmetic_task():
    # tiny task: prompt "12+7=", completion starts with the answer
    completions = ["19", "19 because 12+7", "18", "答案是１９。", "", "2.0"]
    answer = ["19", 19, "19", "19", "19", "2"]
    assert number_match(completions, answer) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert number_match(["12+7=19"], ["19"], position="last") == [1.0]
    assert number_match(["12+7=19"], ["19"]) == [0.0]
    assert number_match(["5"], ["no number"]) == [None]


def test_number_close_partial_credit_by_hand():
    from rewards.exact import number_close

    # gold 20: |15-20|/20 = 0.25 -> 0.75; 40 -> 1 - 20/20 = 0; 20 -> 1; no number -> 0.
    got = number_close(["15", "40<|endoftext|>", "答案是 20。", "不知道"], ["20", "20", "20", "20"])
    assert got == [0.75, 0.0, 1.0, 0.0]
    # gold 0 uses the floor 1: 0.5 -> 0.5; answer without a number -> None.
    assert number_close(["0.5", "3"], ["0", "n/a"]) == [0.5, None]
