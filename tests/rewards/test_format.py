"""rewards.format: R1 structure, think-only format, code format, tag counts, reasoning steps
(hand-computed, and against TRL's think_format_reward)."""

from rewards.format import code_format, reasoning_steps, tag_count, think_answer, think_format


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


THINK_CASES = [  # (completion, think_format)
    ("<think>\n先算 2+2\n</think>\n答案是 4", 1.0),
    ("<think>reasoning</think>The answer is \\boxed{4}.", 1.0),
    ("<think>a</think><answer>4</answer>", 1.0),
    ("<think>a</think>  ", 0.0),                       # no answer after the reasoning
    ("<think>a<think>b</think>c", 0.0),                # opened twice
    ("<think>a</think>b</think>c", 0.0),               # closed twice
    ("answer first <think>a</think>b", 0.0),           # not at the start
    ("<think>never closed, 答案 4", 0.0),
    ("", 0.0),
]


def test_think_format():
    assert think_format([c for c, _ in THINK_CASES]) == [e for _, e in THINK_CASES]


def test_think_format_agrees_with_trl_where_an_answer_follows():
    from trl.rewards import think_format_reward

    differ = {"<think>a</think>  ", "<think>a</think>b</think>c"}  # TRL passes an empty answer and </think> twice
    chat = [[{"role": "assistant", "content": c}] for c, _ in THINK_CASES if c and c not in differ]
    assert think_format(chat) == think_format_reward(chat)
    assert think_format_reward([[{"role": "assistant", "content": c}] for c in sorted(differ)]) == [1.0, 1.0]


def test_think_format_reads_the_rendered_prompt_for_chat_data():
    # the R1-Distill template opens <think> in the generation prompt; the message list does not show it
    prompts = [[{"role": "user", "content": "1+1?"}]] * 2
    chat = [[{"role": "assistant", "content": "嗯，等于二</think>2"}]] * 2
    rendered = ["<｜User｜>1+1?<｜Assistant｜><think>\n", "User: 1+1?\nAssistant:"]
    assert think_format(chat, prompts=prompts, prompt_texts=rendered) == [1.0, 0.0]
    assert think_answer([[{"role": "assistant", "content": "嗯</think><answer>2</answer>"}]], prompts[:1],
                        prompt_texts=rendered[:1]) == [1.0]


def test_code_format():
    c = [
        "<think>先读输入</think>\n<answer>```python\nprint(sum(map(int, input().split())))\n```</answer>",
        "<think>plan</think><answer>Here:\n```Python\nx = 1\n```\ndone</answer>",   # prose around: fine
        "<think>plan</think><answer>print(1)</answer>",                               # no fence
        "<think>plan</think><answer>```cpp\nint main(){}\n```</answer>",              # other language
        "```python\nprint(1)\n```",                                                  # no R1 structure
        "<think>plan</think><answer>```python print(1)```</answer>",                  # fence without a newline
    ]
    assert code_format(c) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert code_format(c[3:4], language="cpp") == [1.0]


def test_hash_answer_wants_one_final_number_line():
    from rewards.format import hash_answer

    c = [
        "12 / 3 = 4\n#### 4",           # ok
        "so\n#### $1,200.50\n\n",       # ok: $, thousands, decimals, trailing whitespace
        "#### -3",                       # ok: negative
        "#### 50%",                      # ok: percent
        "#### 4\nbecause 2+2",           # not the last line
        "#### 4\n#### 4",                # twice
        "the answer #### 4",             # not at a line start
        "#### four",                     # not a number
        "#### 4 apples",                 # text after the number
        "#### 1,20",                     # a broken thousands group
        "",
    ]
    assert hash_answer(c) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert hash_answer([[{"role": "assistant", "content": "x\n#### 7"}]]) == [1.0]
