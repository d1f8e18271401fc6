"""Tools and environments on TRL's contract: a TRL user's file (tools, an environment class with
reset, two tools and get_reward) loads unchanged; what cannot be used is one line before launch;
calls follow TRL's failure rule (a raising or unknown tool answers {"error": ...} and counts)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlkit.agent.tools import call_tools, load_environments, load_tools, tool_dict, tool_methods
from rlkit.errors import ConfigError
from tests.agent.scripted import USER_FILE


@pytest.fixture()
def user_dir(tmp_path):
    (tmp_path / "my_tools.py").write_text(USER_FILE)
    return str(tmp_path)


def test_a_trl_users_tools_and_environment_load_unchanged(user_dir):
    tools = load_tools(["my_tools.py:add", "my_tools.py:wait"], user_dir)
    assert [t.__name__ for t in tools] == ["add", "wait"]
    envs = load_environments("my_tools.py:Counter", user_dir)
    assert envs.tools == {None: ["increment", "read"]}  # public methods but reset / get_reward
    assert [name for name, _ in envs.rewards] == ["Counter"]
    rows = [{"prompt": "p", "start": 3}, {"prompt": "q", "start": 5}]
    first = envs.draw(rows)
    assert len({id(e) for e in first}) == 2  # an instance per rollout
    for env, row in zip(first, rows):
        assert env.reset(**envs.reset_kwargs(row)) == f"The counter starts at {row['start']}."
    ahead = envs.draw(rows[:1])  # a generation started while `first` is not scored yet: new instances
    assert ahead[0] not in first
    envs.release(first + ahead)
    assert envs.draw(rows) == first  # pooled: reused at the next step once released, reset again
    # tools of one rollout's instance act on that instance only
    res = call_tools([{"type": "function", "function": {"name": "increment", "arguments": {"by": 7}}},
                      {"type": "function", "function": {"name": "read", "arguments": {}}}],
                     tool_dict(tool_methods(first[0])))
    assert [m["content"] for m in res.messages] == ["10", "10"] and (res.calls, res.failures) == (2, 0)
    assert first[1].total == 5
    (_, reward), = envs.rewards
    assert reward(environments=first) == [1.0, 0.0]


def test_what_cannot_be_a_tool_is_one_line_before_launch(user_dir):
    with pytest.raises(ConfigError, match=r"^rollout.tools\[1\]: tool nodoc has no schema the model can see: .*"
                                          r"docstring.*as in TRL\)$"):
        load_tools(["my_tools.py:add", "my_tools.py:nodoc"], user_dir)
    with pytest.raises(ConfigError, match=r"^rollout.tools\[0\]: .*module .*my_tools.py.* has no function 'ad'"):
        load_tools(["my_tools.py:ad"], user_dir)
    with pytest.raises(ConfigError, match=r"^rollout.tools\[0\]: 'missing.py:add' — file .*missing.py not found"):
        load_tools(["missing.py:add"], user_dir)
    with pytest.raises(ConfigError, match=r"^rollout.tools\[0\]: 'my_tools.py:Counter' is not a function"):
        load_tools(["my_tools.py:Counter"], user_dir)
    with pytest.raises(ConfigError, match=r"^rollout.environment.b: NoReset has no reset\(\)"):
        load_environments({"a": "my_tools.py:Counter", "b": "my_tools.py:NoReset"}, user_dir)
    envs = load_environments({"a": "my_tools.py:Counter"}, user_dir)
    with pytest.raises(ConfigError, match=r"row 1 has environment 'c', which rollout.environment does not name"):
        envs.draw([{"environment": "a"}, {"environment": "c"}])


def test_tool_calls_follow_trls_failure_rule(user_dir):
    tools = tool_dict(load_tools(["my_tools.py:add", "my_tools.py:boom", "my_tools.py:wait"], user_dir))

    def call(name, **arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    res = call_tools([call("add", a=2, b=3), call("boom", x=1), call("nope"), call("wait", seconds=0.01),
                      {"type": "retrieval", "name": "r"}], tools)
    assert [(m["role"], m["name"], m["content"]) for m in res.messages] == [
        ("tool", "add", "5"), ("tool", "boom", "{'error': 'the tool broke'}"),
        ("tool", "nope", "{'error': 'Tool nope not found.'}"), ("tool", "wait", "waited"),
        ("tool", "r", "{'error': 'Unsupported tool call type: retrieval'}")]
    assert (res.calls, res.failures) == (5, 3)
    # a tool that outlives the per-call timeout fails like a raising one, and the turn goes on
    t = time.perf_counter()
    res = call_tools([call("wait", seconds=5.0), call("add", a=1, b=1)], tools, timeout_s=0.2)
    assert time.perf_counter() - t < 2.0
    assert [m["content"] for m in res.messages] == ["{'error': 'Tool wait timed out after 0.2 s.'}", "2"]
    assert res.failures == 1
    # wrong arguments are the tool raising: the model sees the error
    res = call_tools([call("add", a=1)], tools)
    assert res.failures == 1 and "missing 1 required positional argument: 'b'" in res.messages[0]["content"]
    assert asyncio.iscoroutinefunction(tools["wait"])
