"""The turn loop on hand-built conversations (a scripted engine, the tiny tool tokenizer): every
token of a multi-turn completion lines up with its mask and logprob, tool results are masked out
of the loss, and TRL's rules hold (failure results, rollback on overflow, the round limit)."""

from __future__ import annotations

import pytest
import torch

from rlkit.agent.loop import Agent, rollout_metrics
from rlkit.agent.template import suffix_ids
from rlkit.agent.tools import load_environments, load_tools
from rlkit.errors import ConfigError
from rlkit.grpo.batch import GRPOBatch, Rollout
from rlkit.rollout.samples import Sample
from tests.agent.scripted import USER_FILE

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tok():
    from rlkit.tiny import build_tokenizer

    return build_tokenizer(512, tools=True)


@pytest.fixture()
def user_dir(tmp_path):
    (tmp_path / "my_tools.py").write_text(USER_FILE)
    return str(tmp_path)


class Scripted:
    """An engine that answers each prompt with the next text of its episode's script; records the
    prompts it was sent. Logprobs are distinct per token (-(turn + 1) - t / 100)."""

    def __init__(self, tok, scripts, cut=None):
        self.tok, self.scripts, self.cut, self.sent = tok, scripts, cut, []
        self.turn = {}

    def __call__(self, prompts, sampling, seed):
        out = []
        for p in prompts:
            k = next(i for i, s in enumerate(self.scripts) if self.first(i) == p[:len(self.first(i))])
            t = self.turn.get(k, 0)
            self.turn[k] = t + 1
            self.sent.append((k, list(p)))
            ids = self.tok(self.scripts[k][t], add_special_tokens=False)["input_ids"]
            finish = "stop"
            if len(ids) > sampling.max_tokens:
                ids, finish = ids[:sampling.max_tokens], "length"
            out.append(Sample(0, list(p), ids, self.scripts[k][t], [-(t + 1) - j / 100 for j in range(len(ids))],
                              finish))
        return out

    def first(self, k):
        return self.prompts[k]


def play(agent, rows, scripts, n=1):
    episodes = agent.episodes(rows, n)
    engine = Scripted(agent.tokenizer, scripts)
    engine.prompts = [e.prompt_ids for e in episodes]
    from rlkit.rollout.samples import Sampling

    return agent.run(episodes, engine, Sampling(max_tokens=agent.max_tokens), seed=0), engine


def test_two_turns_line_up_tokens_masks_and_logprobs(tok, user_dir):
    agent = Agent(tok, load_tools(["my_tools.py:add"], user_dir), max_tokens=200)
    first = CALL.format(name="add", args='{"a": 3, "b": 4}')
    (e,), engine = play(agent, [{"prompt": "What is 3+4?"}], [[first, "The answer is 7<|im_end|>"]])
    ids1 = tok(first, add_special_tokens=False)["input_ids"]
    ids2 = tok("The answer is 7<|im_end|>", add_special_tokens=False)["input_ids"]
    suffix = suffix_ids(tok, [{"role": "tool", "name": "add", "content": "7"}])
    assert e.completion_ids == ids1 + suffix + ids2
    assert e.tool_mask == [1] * len(ids1) + [0] * len(suffix) + [1] * len(ids2)
    assert e.logprobs == [-1 - j / 100 for j in range(len(ids1))] + [0.0] * len(suffix) + \
        [-2 - j / 100 for j in range(len(ids2))]
    assert "<tool_response>\n7\n</tool_response>" in tok.decode(suffix)
    # the second turn continues the same tokens (no re-tokenization of the conversation)
    assert [p for _, p in engine.sent] == [e.prompt_ids, e.prompt_ids + ids1 + suffix]
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
    assert e.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}
    assert e.messages[1] == {"role": "tool", "name": "add", "content": "7"}
    assert e.messages[2]["content"] == "The answer is 7"
    assert (e.calls, e.failures, e.turns, e.finish) == (1, 0, 2, "stop")
    # the tool's schema reached the model through the chat template
    assert "add(a, b)" in tok.decode(e.prompt_ids)

    # In the batch, the tool result is out of the loss and the engine logprobs sit on their tokens.
    s = e.sample("")
    r = Rollout(s.prompt_token_ids, s.token_ids, False, s.logprobs, 0, s.tool_mask)
    batch = GRPOBatch.collate([r], torch.zeros(1), pad_id=0)
    p = len(e.prompt_ids)
    assert batch.completion_mask[0, p:].tolist() == e.tool_mask
    assert int(batch.completion_mask[0, :p].sum()) == 0
    loss_tokens = batch.input_ids[0][batch.completion_mask[0].bool()].tolist()
    assert loss_tokens == ids1 + ids2
    assert batch.engine_logp[0, p - 1:].tolist() == pytest.approx(e.logprobs)
    m = rollout_metrics([s], 0.5)
    assert m["tools/call_frequency"] == 1.0 and m["tools/turns_mean"] == 2.0
    assert m["tools/masked_frac"] == pytest.approx(len(suffix) / len(e.completion_ids))


def test_failures_follow_trls_rule(tok, user_dir):
    agent = Agent(tok, load_tools(["my_tools.py:add", "my_tools.py:boom"], user_dir), max_tokens=300)
    calls = [CALL.format(name="boom", args='{"x": 1}'), CALL.format(name="nope", args="{}"), "done<|im_end|>"]
    (e,), _ = play(agent, [{"prompt": "go"}], [calls])
    results = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert results == ["{'error': 'the tool broke'}", "{'error': 'Tool nope not found.'}"]
    assert (e.calls, e.failures, e.turns) == (2, 2, 3)
    assert rollout_metrics([e.sample("")], 0.0)["tools/failure_frequency"] == 1.0


def test_overflowing_results_roll_back_and_the_round_limit_holds(tok, user_dir):
    tools = load_tools(["my_tools.py:add"], user_dir)
    call = CALL.format(name="add", args='{"a": 1, "b": 2}')
    n_call = len(tok(call, add_special_tokens=False)["input_ids"])
    # room for the call but not for its result: the result is dropped, the episode ends as it is
    (e,), engine = play(Agent(tok, tools, max_tokens=n_call + 3), [{"prompt": "x"}], [[call, "never"]])
    assert [m["role"] for m in e.messages] == ["assistant"] and e.tool_mask == [1] * n_call
    assert e.calls == 1 and len(engine.sent) == 1
    # max_tool_calls=1: the second round's calls are not run
    (e,), engine = play(Agent(tok, tools, max_tool_calls=1, max_tokens=400), [{"prompt": "x"}], [[call, call, "z"]])
    assert e.calls == 1 and e.turns == 2 and len(engine.sent) == 2
    assert e.messages[-1]["tool_calls"]  # the model's last word is a call nobody ran
    # a turn cut at the budget never calls its tools
    (e,), engine = play(Agent(tok, tools, max_tokens=n_call - 2), [{"prompt": "x"}], [[call, "z"]])
    assert e.finish == "length" and e.calls == 0 and len(engine.sent) == 1


def test_an_environment_per_rollout_with_reset_text_and_bound_tools(tok, user_dir):
    envs = load_environments("my_tools.py:Counter", user_dir)
    agent = Agent(tok, environments=envs, max_tokens=400)
    inc = CALL.format(name="increment", args='{"by": 7}')
    rows = [{"prompt": "count", "start": 3}, {"prompt": "count", "start": 5}]
    episodes, _ = play(agent, rows, [[inc, "ok<|im_end|>"], ["no<|im_end|>"]])
    assert [e.environment.total for e in episodes] == [10, 5]  # each rollout's calls hit its own instance
    assert episodes[0].prompt[-1]["content"] == "count" + "The counter starts at 3."
    assert "increment(by) read()" in tok.decode(episodes[0].prompt_ids)
    assert episodes[0].messages[1]["content"] == "10"
    (_, reward), = envs.rewards
    assert reward(environments=[e.environment for e in episodes]) == [1.0, 0.0]


def test_a_template_that_cannot_call_tools_is_one_line(user_dir):
    from rlkit.tiny import build_tokenizer

    with pytest.raises(ConfigError, match=r"^rollout.tools: the tokenizer's chat template cannot render a tool call"):
        Agent(build_tokenizer(512), load_tools(["my_tools.py:add"], user_dir))


GAME = '''
class Guess:
    """A gym-style interaction: the model guesses a number, the game says higher or lower."""

    def reset(self, target, **row):
        self.target, self.guesses = int(target), 0
        return " Guess my number."

    def step(self, message):
        self.guesses += 1
        guess = int(message["content"])
        if guess == self.target:
            return None, 1.0, True
        return ("higher" if guess < self.target else "lower"), -0.1, False


class Broken:
    def reset(self, **row):
        return None

    def step(self, message):
        raise KeyError("score")
'''


def test_a_gym_style_interaction_answers_each_turn(tok, tmp_path):
    from rlkit.agent.tools import environment_rewards, load_interaction
    from rlkit.errors import UserError

    (tmp_path / "game.py").write_text(GAME)
    envs = load_interaction("game.py:Guess", str(tmp_path))
    agent = Agent(tok, environments=envs, max_tokens=200)
    (e,), engine = play(agent, [{"prompt": "Play.", "target": 7}], [["5<|im_end|>", "9<|im_end|>", "7<|im_end|>"]])
    assert [m["role"] for m in e.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in e.messages if m["role"] == "user"] == ["higher", "lower"]
    assert e.prompt[-1]["content"] == "Play. Guess my number."
    assert e.env_reward == pytest.approx(0.8) and e.turns == 3 and e.calls == 0
    observation = suffix_ids(tok, [{"role": "user", "content": "higher"}])
    first = tok("5<|im_end|>", add_special_tokens=False)["input_ids"]
    assert e.completion_ids[:len(first) + len(observation)] == first + observation
    assert e.tool_mask[:len(first) + len(observation)] == [1] * len(first) + [0] * len(observation)
    assert engine.sent[1][1] == e.prompt_ids + first + observation  # the next turn continues the tokens
    # its reward source: the steps' sum, for this class's rollouts
    (source,) = environment_rewards(envs)
    assert source.name == "Guess" and source.fn(env_rewards=[e.env_reward], environments=[e.environment]) == [
        pytest.approx(0.8)]
    # a step that raises is the user's bug: one line naming the class
    broken = Agent(tok, environments=load_interaction("game.py:Broken", str(tmp_path)), max_tokens=50)
    with pytest.raises(UserError, match=r"^rollout.interaction: Broken.step failed: KeyError: 'score' \(step"):
        play(broken, [{"prompt": "x"}], [["1<|im_end|>"]])
    # a template that cannot render the game's next user turn: one line, not jinja's traceback mid-step
    import copy

    one_turn = copy.deepcopy(tok)
    from rlkit.tiny import TOOL_CHAT_TEMPLATE

    refuse = "{% if m['role'] == 'user' and loop.index > 2 %}{{ raise_exception('one user turn only') }}{% endif %}"
    assert TOOL_CHAT_TEMPLATE.count("{% for m in messages %}") == 1
    one_turn.chat_template = TOOL_CHAT_TEMPLATE.replace("{% for m in messages %}", "{% for m in messages %}" + refuse)
    game = Agent(one_turn, environments=load_interaction("game.py:Guess", str(tmp_path)), max_tokens=50)
    with pytest.raises(UserError, match=r"^rollout.interaction: the tokenizer's chat template cannot continue the "
                                        r"conversation with user turns \(one user turn only\): use a model"):
        play(game, [{"prompt": "x", "target": 5}], [["3<|im_end|>", "5<|im_end|>"]])
    # a reset that does not take the row's columns: one line too, not the user's traceback mid-step
    strict = Agent(tok, environments=load_interaction("game.py:Guess", str(tmp_path)), max_tokens=50)
    with pytest.raises(UserError, match=r"^rollout.interaction: Guess.reset failed: TypeError: .*'target'.* \(reset "
                                        r"receives every column of the row as a keyword: take \*\*kwargs\)$"):
        play(strict, [{"prompt": "x"}], [["1<|im_end|>"]])
    with pytest.raises(ConfigError, match=r"^rollout.interaction: Counter has no step\(\)"):
        (tmp_path / "my_tools.py").write_text(USER_FILE)
        load_interaction("my_tools.py:Counter", str(tmp_path))
