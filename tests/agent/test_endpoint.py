"""The OpenAI-compatible endpoint and the agent programs behind it, on a scripted engine and the
tiny tool tokenizer, with the real `openai` client: every turn's recorded tokens are the engine's
sampled tokens, tool results are masked, a program that rewrites its history forks a new sample
(never a splice), and a program that crashes, hangs, floods or sends malformed requests costs only
its own rollout, with one log line per kind."""

from __future__ import annotations

import json
import logging
import time

import pytest

from rlkit.agent.chat_api import normalise
from rlkit.agent.program import ProgramAgent
from rlkit.agent.template import prepare_tokenizer
from rlkit.program_config import ProgramConfig
from rlkit.rollout.samples import Sample, Sampling
from tests.agent.scripted import ROWS, Engine, assert_recorded_exactly

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tok():
    from rlkit.tiny import build_tokenizer

    return prepare_tokenizer(build_tokenizer(512, tools=True))


def calculator(row, client, exclude_none=True):
    """A harness on the OpenAI SDK: ask, run the model's tool calls itself, ask again, until an
    answer without calls; returns 1.0 when the answer holds the sum. The assistant messages go
    back as the SDK dumps them (`exclude_none=False`: with `content: None` and the SDK's other
    empty fields)."""
    messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        reward = _take(row, messages, reply.choices[0].message, exclude_none)
        if reward is not None:
            return reward
    return 0.0


async def async_calculator(row, client):
    """`calculator` written against `openai.AsyncOpenAI`, as asynchronous harnesses are (the Agents
    SDK's `Runner.run`, LangGraph): every request awaited."""
    messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        reward = _take(row, messages, reply.choices[0].message)
        if reward is not None:
            return reward
    return 0.0


def _take(row, messages, message, exclude_none=True):
    """The harness's side of a turn: the answer's reward (1.0 when it holds the sum), or None once
    the model's tool calls are run and their results appended to `messages`."""
    messages.append(message.model_dump(exclude_none=exclude_none))
    if not message.tool_calls:
        return float(str(row["a"] + row["b"]) in (message.content or ""))
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return None


def agent(tok, program, **cfg):
    cfg = {"timeout_s": 20.0, "batch_wait_s": 0.01, **cfg}
    return ProgramAgent(tok, program, ProgramConfig(**cfg), max_tokens=300, max_model_len=1024,
                        recipe={"temperature": 1.0, "top_p": 1.0})


@pytest.mark.parametrize("exclude_none", [True, False])
def test_every_turn_records_the_engines_tokens_and_masks_the_tool_results(tok, exclude_none):
    engine = Engine(tok)
    # (the batcher fires once every live program has asked: 2 s is only its limit, which CI's load
    # passed at 10 ms, the programs' second requests coming apart)
    a = agent(tok, lambda row, client: calculator(row, client, exclude_none), batch_wait_s=2.0)
    try:
        batch = a.generate(ROWS, engine, Sampling(max_tokens=300), n=2, seed=0)
    finally:
        a.close()
    assert len(batch.samples) == 4 and [s.prompt_index for s in batch.samples] == [0, 0, 1, 1]
    assert [s.env_reward for s in batch.samples] == [1.0] * 4
    assert batch.metrics["program/forks_mean"] == 0.0 and batch.metrics["program/requests_mean"] == 2.0
    sampled = {}  # the engine's tokens and logprobs, by the prompt they answered
    for prompts, out in engine.calls:
        for p, s in zip(prompts, out):
            sampled[tuple(p)] = s
    for s in batch.samples:
        assert s.forks == [] and s.turns == 2 and s.tool_calls == 1
        assert assert_recorded_exactly(s, [(p, o) for prompts, out in engine.calls for p, o in zip(prompts, out)]) == 2
        first = sampled[tuple(s.prompt_token_ids)]
        n1 = len(first.token_ids)
        assert s.token_ids[:n1] == first.token_ids and s.logprobs[:n1] == first.logprobs
        # the second turn was generated from exactly the recorded tokens, and recorded as sampled
        second_prompt = next(p for p in sampled if len(p) > len(s.prompt_token_ids) and
                             list(p[:len(s.prompt_token_ids)]) == s.prompt_token_ids and
                             list(p[len(s.prompt_token_ids):len(s.prompt_token_ids) + n1]) == first.token_ids)
        second = sampled[second_prompt]
        suffix = len(second_prompt) - len(s.prompt_token_ids) - n1
        assert list(second_prompt) == s.prompt_token_ids + s.token_ids[:n1 + suffix]
        assert s.token_ids[n1 + suffix:] == second.token_ids and s.logprobs[n1 + suffix:] == second.logprobs
        assert s.tool_mask == [1] * n1 + [0] * suffix + [1] * len(second.token_ids)
        assert "<tool_response>" in tok.decode(s.token_ids[n1:n1 + suffix])
        assert [m["role"] for m in s.messages] == ["assistant", "tool", "assistant"]
    # both programs' turns shared the engine's calls: two calls, not four
    assert batch.metrics["program/engine_calls"] == 2.0


def rewriting(row, client):
    """Drops its first exchange from the history before the second request (a harness that
    summarises or truncates)."""
    messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    call = reply.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}? The tool says {args['a'] + args['b']}"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return None


def test_a_history_the_program_rewrote_forks_a_new_sample_never_a_splice(tok):
    engine = Engine(tok)
    a = agent(tok, rewriting)
    try:
        batch = a.generate(ROWS[:1], engine, Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    (s,) = batch.samples
    assert batch.metrics["program/forks_mean"] == 1.0
    (fork,) = s.forks
    # each sample is one engine call's prompt and exactly its tokens: nothing re-tokenised joined
    calls = [(list(p), o) for prompts, out in engine.calls for p, o in zip(prompts, out)]
    assert (fork.prompt_token_ids, fork.token_ids, fork.logprobs) == (calls[0][0], calls[0][1].token_ids,
                                                                      calls[0][1].logprobs)
    assert (s.prompt_token_ids, s.token_ids, s.logprobs) == (calls[1][0], calls[1][1].token_ids, calls[1][1].logprobs)
    assert fork.tool_mask == [1] * len(fork.token_ids) and s.env_reward is None


def test_streaming_gives_the_same_turn_in_chunks(tok):
    """A streamed turn comes as chunks ending in its finish reason; with `stream_options:
    {include_usage: true}` one more chunk, without choices, carries the turn's token counts (what
    a harness that counts tokens reads), and the other chunks' usage is null."""
    def streaming(row, client):
        messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
        chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD], stream=True))
        calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and all(ch.usage is None for ch in chunks)
        counted = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD], stream=True,
                                                      stream_options={"include_usage": True}))
        assert counted[-2].choices[0].finish_reason == "tool_calls" and counted[-1].choices == []
        usage = counted[-1].usage
        assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert all(ch.usage is None for ch in counted[:-1])
        return float(json.loads(calls[0].function.arguments) == {"a": row["a"], "b": row["b"]})

    a = agent(tok, streaming)
    try:
        batch = a.generate(ROWS, Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert [s.env_reward for s in batch.samples] == [1.0, 1.0]


def test_crash_hang_flood_and_malformed_requests_cost_only_their_rollout(tok, caplog):
    import httpx

    def mixed(row, client):
        kind = row["kind"]
        if kind == "crash":
            raise ValueError("the harness broke")
        if kind == "hang":
            time.sleep(30)
        if kind == "bad":
            calculator(row, client)
            return "yes"
        if kind == "flood":
            for _ in range(10):
                client.chat.completions.create(model="p", messages=[{"role": "user", "content": "What is 1 + 2?"}])
        if kind == "malformed":
            base = str(client.base_url).rstrip("/")
            r = httpx.post(base + "/chat/completions", json={"messages": "not a list"},
                           headers={"Authorization": f"Bearer {client.api_key}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "malformed"
            client.chat.completions.create(model="p", messages=[{"role": "wizard", "content": "hi"}])
        return calculator(row, client)

    rows = [{"prompt": "q", "a": 2, "b": 3, "kind": k} for k in ("ok", "crash", "hang", "flood", "malformed", "bad")]
    a = agent(tok, mixed, timeout_s=3.0, max_requests=4)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="rlkit"):
            batch = a.generate(rows, Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert time.monotonic() - t0 < 10  # the hung program cost its deadline, no more
    m = batch.metrics
    # one kind per rollout, its first cause (the flooding and the malformed programs then crashed on the errors)
    assert [m[f"program/{k}"] for k in ("crashed", "timed_out", "flooded", "refused", "bad_result")] == [1.0] * 5
    assert batch.samples[0].env_reward == 1.0 and batch.samples[0].turns == 2
    assert batch.samples[1].token_ids == [tok.eos_token_id] and batch.samples[1].tool_mask == [0]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout.program")]
    assert len(lines) == 5 and any("crashed" in x and "the harness broke" in x for x in lines)
    assert any("bad result" in x and "'yes'" in x for x in lines) and batch.samples[5].turns == 2
    assert any("timed out" in x for x in lines) and any("flooded" in x for x in lines)
    assert any("refused" in x and "malformed" in x for x in lines)


def test_an_async_program_is_awaited_with_an_async_client_and_cancelled_at_its_deadline(tok):
    """`async def run(row, client)`: each rollout's coroutine runs on an event loop with an
    `openai.AsyncOpenAI` client bound to its session, so its turns are generated and recorded as a
    synchronous program's are (reward 1.0, two turns, one tool call); one that hangs is cancelled
    at `timeout_s` and costs its rollout only. (Before, the coroutine was never awaited: every
    rollout a bad result.)"""
    import asyncio

    async def program(row, client):
        if row["kind"] == "hang":
            await asyncio.sleep(30)
        return await async_calculator(row, client)

    rows = [{"prompt": "q", "a": 2, "b": 3, "kind": k} for k in ("ok", "hang", "ok")]
    a = agent(tok, program, timeout_s=3.0)
    t0 = time.monotonic()
    try:
        batch = a.generate(rows, Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert time.monotonic() - t0 < 10
    m = batch.metrics
    assert m["program/timed_out"] == 1.0 and m["program/bad_result"] == 0.0 and m["program/crashed"] == 0.0
    good = [batch.samples[0], batch.samples[2]]
    assert [s.env_reward for s in good] == [1.0, 1.0] and [(s.turns, s.tool_calls) for s in good] == [(2, 1)] * 2


def test_a_request_too_long_to_fit_is_refused_unread_and_a_slow_render_delays_no_other_session(tok, monkeypatch):
    """A 600,000-character message is refused (400, context_length_exceeded) before the template
    renders it: the tokenizer never sees it. A render that takes 3 s (a long conversation) runs
    off the endpoint's event loop: another session's request, sent while it runs, is answered at
    once. (Before, both ran on the loop, and every other session waited for them.)"""
    import openai

    rendered = []
    render = type(tok).apply_chat_template

    def slow_render(self, messages, *args, **kwargs):
        rendered.append(sum(len(str(m.get("content") or "")) for m in messages))
        if "SLOW" in str(messages[0].get("content")):
            time.sleep(3.0)
        return render(self, messages, *args, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", slow_render)

    def program(row, client):
        if row["kind"] == "huge":
            try:
                client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x" * 600_000}])
            except openai.BadRequestError as e:
                return float(e.code == "context_length_exceeded")
            return 0.0
        if row["kind"] == "slow":
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "SLOW What is 1 + 2?"}])
            return 1.0
        time.sleep(0.5)  # the slow render has begun
        t0 = time.monotonic()
        client.models.list()
        return float(time.monotonic() - t0 < 1.0)

    rows = [{"prompt": "q", "a": 1, "b": 2, "kind": k} for k in ("huge", "slow", "quick")]
    a = agent(tok, program, timeout_s=20.0)
    try:
        batch = a.generate(rows, Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert [s.env_reward for s in batch.samples] == [1.0, 1.0, 1.0]
    assert rendered and max(rendered) < 1000  # the huge message was never rendered
    assert batch.metrics["program/refused"] == 1.0


def test_a_harness_sampling_settings_are_overridden_or_refused(tok, caplog):
    def hot(row, client):
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "What is 1 + 2?"}],
                                       temperature=0.2, max_tokens=5)
        return 1.0

    a = agent(tok, hot)
    try:
        with caplog.at_level(logging.WARNING, logger="rlkit"):
            batch = a.generate(ROWS[:1], Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert batch.metrics["program/overridden"] == 1.0 and batch.samples[0].env_reward == 1.0
    assert len(batch.samples[0].token_ids) > 5  # the recipe's budget, not the harness's
    assert any("max_tokens, temperature" in r.getMessage() for r in caplog.records)
    a = agent(tok, hot, sampling="refuse")
    try:
        batch = a.generate(ROWS[:1], Engine(tok), Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    assert batch.metrics["program/refused"] == 1.0 and batch.samples[0].env_reward is None


def test_openai_messages_become_what_the_chat_template_takes():
    parts = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    out = normalise([{"role": "developer", "content": parts},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert out[0] == {"role": "system", "content": "be brief"} and out[1]["content"] == ""
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert out[2]["name"] == "add"


def test_a_forked_rollout_trains_each_sample_with_its_advantage_and_survives_a_checkpoint():
    import torch

    from rlkit.grpo.batch import GRPOBatch, Rollout, expand_forks
    from rlkit.grpo.experience import Generation

    fork = Sample(0, [1, 2], [5, 6], "a", [-0.5, -0.6], "stop", tool_mask=[1, 1])
    last = Sample(0, [1, 9], [7, 8, 3], "b", [-0.7, 0.0, -0.8], "stop", tool_mask=[1, 0, 1], forks=[fork])
    plain = Sample(1, [1, 4], [3], "c", [-0.1], "stop", tool_mask=[1], forks=[])
    rollouts = [Rollout(s.prompt_token_ids, s.token_ids, False, s.logprobs, 0, s.tool_mask,
                        forks=tuple(Rollout(f.prompt_token_ids, f.token_ids, False, f.logprobs, 0, f.tool_mask)
                                    for f in s.forks or ())) for s in (last, plain)]
    flat, adv = expand_forks(rollouts, torch.tensor([1.5, -1.5]))
    assert [r.completion_ids for r in flat] == [[5, 6], [7, 8, 3], [3]] and adv.tolist() == [1.5, 1.5, -1.5]
    batch = GRPOBatch.collate(flat, adv, 0, False)
    assert batch.advantages.tolist() == [1.5, 1.5, -1.5] and batch.completion_mask.sum().item() == 2 + 2 + 1
    gen = Generation([{"prompt": "q"}], ["q"], [], None, 0.0, samples=[last, plain])
    from rlkit.agent.loop import AgentBatch

    gen.agent = AgentBatch([last, plain], [[], []], ["q", "q"], None, returned=True)
    back = Generation.restored(gen.state_dict())
    assert back.samples == [last, plain] and back.agent.returned


def test_what_cannot_run_is_one_line_before_launch(tok, tmp_path):
    import socket

    from rlkit.agent.program import load_program
    from rlkit.errors import ConfigError
    from rlkit.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match="program.*not with tools"):
        RolloutConfig(tools=("rlkit.tiny_tools:add",), program=ProgramConfig(fn="rlkit.agent.examples:calculator"))
    (tmp_path / "agents.py").write_text("def one(row):\n    return 1.0\n\nNOT = 3\n")
    with pytest.raises(ConfigError, match=r"rollout.program.fn.*cannot be called as run\(row, client\)"):
        load_program("agents.py:one", str(tmp_path))
    with pytest.raises(ConfigError, match="rollout.program.fn.*not a function"):
        load_program("agents.py:NOT", str(tmp_path))
    with pytest.raises(ConfigError, match="rollout.program.fn.*no function 'run'"):
        load_program("agents.py:run", str(tmp_path))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(ConfigError, match=f"rollout.program.port.*127.0.0.1:{taken.getsockname()[1]}"):
            agent(tok, calculator, port=taken.getsockname()[1])
    finally:
        taken.close()


def responder(row, client, chained=False):
    """The calculator harness on the Responses API: function_call items run by the program, their
    output sent back as function_call_output items (in full, or after previous_response_id)."""
    tool = {"type": "function", "name": "add", "description": "Add two integers.",
            "parameters": ADD["function"]["parameters"]}
    items = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
    reply = client.responses.create(model="p", input=items, tools=[tool])
    calls = [o for o in reply.output if o.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id,
                "output": str(sum(json.loads(c.arguments).values()))} for c in calls]
    if chained:
        reply = client.responses.create(model="p", previous_response_id=reply.id, input=outputs, tools=[tool])
    else:
        items += [o.model_dump(exclude_none=True) for o in reply.output] + outputs
        reply = client.responses.create(model="p", input=items, tools=[tool])
    return float(str(row["a"] + row["b"]) in reply.output_text)


@pytest.mark.parametrize("chained", [False, True])
def test_the_responses_api_takes_the_same_path(tok, chained):
    engine = Engine(tok)
    a = agent(tok, lambda row, client: responder(row, client, chained))
    try:
        batch = a.generate(ROWS, engine, Sampling(max_tokens=300), n=1, seed=0)
    finally:
        a.close()
    calls = [(p, o) for prompts, out in engine.calls for p, o in zip(prompts, out)]
    assert [s.env_reward for s in batch.samples] == [1.0, 1.0] and batch.metrics["program/forks_mean"] == 0.0
    assert all(assert_recorded_exactly(s, calls) == 2 for s in batch.samples)
