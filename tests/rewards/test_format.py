"""rewards.format: R1 structure, tag counts, reasoning steps (hand-computed)."""

from rewards.format import reasoning_steps, tag_count, think_answer


def test_think_answer_strict():
    c = [
        "<think>先算 2+2</think>\n<answer>4</answer>",   # ok
        "  <think>a</think><answer>b</answer>\n",       # ok: whitespace around
        "<think>a</think>text<answer>b</answer>",       # text between
        "<answer>b</answer>",                           # no think
        "<think>a</think><answer>b</answer> extra",     # trailing text
        "<think>a<think>b</think><answer>c</answer>",   # tag twice
        "<think></think><answer>c</answer>",            # empty think
        "",
    ]
    assert think_answer(c) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_think_opened_by_the_prompt():
    prompts = ["<｜User｜>1+1?<｜Assistant｜><think>\n", "plain prompt"]
    c = ["嗯，等于二</think><answer>2</answer>", "嗯</think><answer>2</answer>"]
    assert think_answer(c, prompts=prompts) == [1.0, 0.0]


def test_tag_count_partial_credit():
    c = [
        "<think>a</think><answer>b</answer>",    # 4 tags once: 1.0
        "<think>a</think>",                      # 0.5
        "<think><think>a</think><answer>b",      # think twice: </think>, <answer> -> 0.5
        "没有标签",                               # 0
    ]
    assert tag_count(c) == [1.0, 0.5, 0.5, 0.0]


def test_reasoning_steps():
    c = [
        "Step 1: add. Step 2: carry. Step 3: done.",       # 3 -> 1.0
        "1. read\n2. think\n",                             # 2 -> 2/3
        "首先，计算。然后，检查。",                          # 首先 + 然后 = 2 -> 2/3
        "第一步：读题\n第二步：列式\n第三步：计算\n最后：答案",  # 4 -> capped 1.0
        "- a\n- b\n* c\n",                                  # bullets, 3 -> 1.0 (first at string start)
        "just an answer: 42",                              # 0
    ]
    assert reasoning_steps(c) == [1.0, 2 / 3, 2 / 3, 1.0, 1.0, 0.0]
    assert reasoning_steps(["First, a. Next, b."], min_steps=2) == [1.0]
