"""The inline calculator (`rollout.calculator`): which text it answers and how, and its loop on a
scripted engine that stops as vLLM does at `stop_token_ids` (the tiny tokenizer): the model's
tokens, the calculator's (masked, logprob 0) and the prompts sent line up; the budget holds.
tests/e2e/test_smollm2.py runs it on vLLM with the real model."""

from __future__ import annotations

import pytest
import torch

from rlkit.agent.calculator import Calculator, calculate
from rlkit.agent.loop import rollout_metrics
from rlkit.grpo.batch import GRPOBatch, Rollout
from rlkit.rollout.samples import Sample, Sampling


@pytest.mark.parametrize("text, value", [
    ("He has 10*57 =", "570"), ("Total: 12 * 34=", "408"), ("so 590 - 342 =", "248"),
    ("7/50*150 =", "21"), ("<<7+43=", "50"), ("$1,200 + $300 =", "1500"), ("(3 + 4) * 2 =", "14"),
    ("2 x 3 =", "6"), ("10 / 3 =", "3.3333"), ("1.5 * 3 =", "4.5"), ("5 - 8 =", "-3"), ("-4 * 2 =", "-8"),
    ("a box of 2 * 3 =", "6"), ("so, 3/4 =", "0.75"), ("250 ÷ 4 =", "62.5"), ("77*£1.25 =", "96.25"),
])
def test_the_calculator_answers_arithmetic_before_an_equals_sign(text, value):
    assert calculate(text) == value


@pytest.mark.parametrize("text", [
    "Let x =",                       # no expression
    "5 pounds/day * 30 days =",      # units inside: prose, not a calculation
    "She has 12 apples =",           # a number alone
    "4 / 0 =",                       # no value
    "12 * 34 = 408",                 # not at an equals sign
    "1 + " * 40 + "1 =",             # longer than MAX_EXPRESSION: prose the pattern caught
    "__import__('os') =",
    "2 ** 100 =",                    # no powers
    "1 + 2 + 3 " * 2000 + "apples =",  # in linear time, whatever the model wrote
])
def test_the_calculator_leaves_everything_else_to_the_model(text):
    assert calculate(text) is None


class Segments:
    """An engine whose model writes, for each episode, the next of its segments; it stops after the
    first token in `sampling.stop_token_ids` as vLLM does (a segment may end there only), and
    records the prompts it was sent. Logprobs are distinct per call: -(call + 1) - t / 100."""

    def __init__(self, tok, segments):
        self.tok, self.segments, self.sent, self.calls = tok, segments, [], {}

    def __call__(self, prompts, sampling, seed):
        out = []
        for k, p in enumerate(prompts):
            k = next(i for i, e in enumerate(self.episodes) if p[:len(e.prompt_ids)] == e.prompt_ids)
            t = self.calls.get(k, 0)
            self.calls[k] = t + 1
            self.sent.append((k, list(p)))
            ids = self.tok(self.segments[k][t], add_special_tokens=False)["input_ids"]
            stops = [j for j, x in enumerate(ids) if x in sampling.stop_token_ids]
            assert stops in ([], [len(ids) - 1]), "a segment may stop only at its last token"
            finish = "stop"
            if len(ids) > sampling.max_tokens:
                ids, finish = ids[:sampling.max_tokens], "length"
            out.append(Sample(0, list(p), ids, "", [-(t + 1) - j / 100 for j in range(len(ids))], finish))
        return out


def play(calc, rows, segments, max_tokens=200):
    episodes = calc.episodes(rows, 1)
    engine = Segments(calc.tokenizer, segments)
    engine.episodes = episodes
    return calc.run(episodes, engine, Sampling(max_tokens=max_tokens), seed=0), engine


@pytest.fixture(scope="module")
def tok():
    from rlkit.tiny import build_tokenizer

    return build_tokenizer(512, tools=True)


def test_the_loop_masks_the_calculators_tokens_and_continues_the_same_sequence(tok):
    calc = Calculator(tok, lambda row: row["prompt"])
    assert tok.convert_tokens_to_ids("=") in calc.stop_ids and tok.eos_token_id not in calc.stop_ids
    model = ["12 * 34 =", " apples. Let x =", " y. Then 408 + 2 =", "\n#### 410<|im_end|>"]
    (e,), engine = play(calc, [{"prompt": "Q: 12 apples times 34, plus 2?\nA: "}], [model])
    ids = [tok(s, add_special_tokens=False)["input_ids"] for s in model]
    a408, a410 = (tok(s, add_special_tokens=False)["input_ids"] for s in (" 408", " 410"))
    assert e.completion_ids == ids[0] + a408 + ids[1] + ids[2] + a410 + ids[3]
    assert e.tool_mask == [1] * len(ids[0]) + [0] * len(a408) + [1] * (len(ids[1]) + len(ids[2])) + \
        [0] * len(a410) + [1] * len(ids[3])
    assert e.logprobs == [-1 - j / 100 for j in range(len(ids[0]))] + [0.0] * len(a408) + \
        [-2 - j / 100 for j in range(len(ids[1]))] + [-3 - j / 100 for j in range(len(ids[2]))] + \
        [0.0] * len(a410) + [-4 - j / 100 for j in range(len(ids[3]))]
    assert (e.calls, e.turns, e.finish) == (2, 4, "stop")  # "Let x =" is the model's to go on from
    # every call continues the same tokens: the prompt, then all the completion so far
    assert [p for _, p in engine.sent] == [e.prompt_ids, e.prompt_ids + ids[0] + a408,
                                           e.prompt_ids + ids[0] + a408 + ids[1],
                                           e.prompt_ids + ids[0] + a408 + ids[1] + ids[2] + a410]
    assert tok.decode(e.completion_ids).startswith("12 * 34 = 408 apples. Let x = y. Then 408 + 2 = 410\n")

    # in the batch the calculator's tokens are out of the loss
    s = e.sample(tok.decode(e.completion_ids))
    batch = GRPOBatch.collate([Rollout(s.prompt_token_ids, s.token_ids, False, s.logprobs, 0, s.tool_mask)],
                              torch.zeros(1), pad_id=0)
    loss_tokens = batch.input_ids[0][batch.completion_mask[0].bool()].tolist()
    assert loss_tokens == ids[0] + ids[1] + ids[2] + ids[3]
    m = rollout_metrics([s], 0.0)
    assert m["tools/call_frequency"] == 2.0 and m["tools/masked_frac"] == pytest.approx(
        (len(a408) + len(a410)) / len(e.completion_ids))


def test_the_token_budget_holds_across_calculator_answers(tok):
    model = ["12 * 34 =", " and then 9 * 9 =", " done<|im_end|>"]
    first = len(tok(model[0], add_special_tokens=False)["input_ids"])
    calc = Calculator(tok, lambda row: row["prompt"])
    (e,), engine = play(calc, [{"prompt": "Q: "}], [model], max_tokens=first + 1)  # no room for " 408"
    assert (len(e.completion_ids), e.finish, e.calls, len(engine.sent)) == (first, "length", 0, 1)

    (e,), engine = play(calc, [{"prompt": "Q: "}], [model], max_tokens=first + 6)  # " 408", 4 model tokens
    assert len(e.completion_ids) == first + 6 and e.finish == "length" and e.calls == 1
    assert e.tool_mask[-4:] == [1, 1, 1, 1] and len(engine.sent) == 2


def test_episodes_are_played_in_groups_the_kv_cache_holds(tok):
    """With room for two episodes' prompts and budgets in the KV cache, five episodes go to the
    engine two at a time, each group to its end (its rounds reuse the engine's prefix cache), and
    come out as when all are played at once."""

    class Sizes(Segments):
        def __call__(self, prompts, sampling, seed):
            self.sizes = [*getattr(self, "sizes", []), len(prompts)]
            return super().__call__(prompts, sampling, seed)

    rows = [{"prompt": f"Q{i}: "} for i in range(5)]
    segments = [["12 * 34 =", f" so {i} + 1 =", " done<|im_end|>"] for i in range(5)]
    out = {}
    for room in (None, 2):
        calc = Calculator(tok, lambda row: row["prompt"])
        episodes = calc.episodes(rows, 1)
        if room:
            calc.kv_tokens = sum(len(e.prompt_ids) + 200 for e in episodes[:room])
        engine = Sizes(tok, segments)
        engine.episodes = episodes
        calc.run(episodes, engine, Sampling(max_tokens=200), seed=0)
        out[room] = [(e.completion_ids, e.tool_mask, e.logprobs, e.calls) for e in episodes], engine.sizes
    assert out[None][1] == [5, 5, 5] and out[2][1] == [2, 2, 2, 2, 2, 2, 1, 1, 1]
    assert out[2][0] == out[None][0] and all(calls == 2 for *_, calls in out[2][0])


def test_the_calculator_knows_how_many_tokens_the_cpu_kv_caches_hold(tmp_path):
    import json

    from rlkit.agent.calculator import kv_cache_tokens
    from rlkit.rollout.config import RolloutConfig

    config = {  # SmolLM2-135M's shape: 23040 bytes of bf16 KV a token
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    one = RolloutConfig(kv_cache_gib=1.0)
    assert kv_cache_tokens(one, str(tmp_path), "bf16") == 2**30 // 23040 == kv_cache_tokens(one, str(tmp_path), "auto")
    assert kv_cache_tokens(RolloutConfig(kv_cache_gib=1.0, num_engines=2), str(tmp_path), "bf16") == 2 * 46603
    assert kv_cache_tokens(one, str(tmp_path), "fp32") == 2**30 // 46080
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))  # an imported GGUF
    assert kv_cache_tokens(one, str(tmp_path), "auto") == 2**30 // 46080
    assert kv_cache_tokens(RolloutConfig(kv_cache_gib=None), str(tmp_path), "bf16") is None
    assert kv_cache_tokens(one, str(tmp_path / "missing"), "bf16") is None
