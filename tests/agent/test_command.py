"""An agent program that is a command, run once per rollout: a Python file on the `openai` SDK
that finds its session in OPENAI_BASE_URL / OPENAI_API_KEY. In the code sandbox's walls
(`isolation: namespaces`) it reaches the endpoint and nothing else: not another port of the host,
not a file outside the recipe's folder; a command that fails or hangs costs its rollout."""

from __future__ import annotations

import socket
import time

import pytest

from rlkit.agent.program import ProgramAgent
from rlkit.program_config import ProgramConfig
from rlkit.rollout.samples import Sampling
from rlkit.sandbox.walls import namespaces_problem
from tests.agent.scripted import ROWS, Engine, assert_recorded_exactly

AGENT = r'''
import json, os, socket, sys
from openai import OpenAI

row = json.loads(os.environ["RLKIT_ROW"])
assert json.loads(sys.stdin.read()) == row
escaped = []
try:  # another port of the host
    socket.create_connection(("127.0.0.1", row["port"]), timeout=2).close()
    escaped.append("port")
except OSError:
    pass
try:  # a file outside the recipe's folder
    open(row["secret"]).read()
    escaped.append("file")
except OSError:
    pass
client = OpenAI()
messages = [{"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]
for _ in range(3):
    message = client.chat.completions.create(model="p", messages=messages, tools=[{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {}}}}]).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
print("escaped:", escaped, file=sys.stderr)
print(json.dumps({"reward": float(str(row["a"] + row["b"]) in message.content) if not escaped else -1.0}))
'''


@pytest.fixture(scope="module")
def tok():
    from rlkit.agent.template import prepare_tokenizer
    from rlkit.tiny import build_tokenizer

    return prepare_tokenizer(build_tokenizer(512, tools=True))


@pytest.fixture()
def recipe_dir(tmp_path):
    folder = tmp_path / "recipe"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT)
    for p in (tmp_path, folder):
        p.chmod(0o755)  # a sandboxed command runs as a throwaway uid when rlkit runs as root
    (tmp_path / "secret.txt").write_text("the driver's")
    return folder


def play(tok, recipe_dir, rows, **cfg):
    cfg = {"command": "python agent.py", "timeout_s": 30.0, **cfg}
    agent = ProgramAgent(tok, None, ProgramConfig(**cfg), max_tokens=300, max_model_len=1024,
                         recipe={"temperature": 1.0}, recipe_dir=str(recipe_dir))
    engine = Engine(tok)
    try:
        return agent.generate(rows, engine, Sampling(max_tokens=300), n=1, seed=0), engine
    finally:
        agent.close()


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_a_command_trains_through_the_endpoint_and_in_the_sandbox_reaches_nothing_else(tok, recipe_dir, isolation):
    if isolation == "namespaces" and namespaces_problem():
        pytest.skip(namespaces_problem())
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    rows = [{**r, "port": other.getsockname()[1], "secret": str(recipe_dir.parent / "secret.txt")} for r in ROWS]
    try:
        batch, engine = play(tok, recipe_dir, rows, isolation=isolation)
    finally:
        other.close()
    calls = [(p, o) for prompts, out in engine.calls for p, o in zip(prompts, out)]
    assert batch.metrics["program/crashed"] == 0.0, batch.metrics
    for s in batch.samples:
        assert assert_recorded_exactly(s, calls) == 2 and s.forks == []
    # walled off, it reached the endpoint only; as a plain process it reached the port and the file too
    assert [s.env_reward for s in batch.samples] == ([1.0, 1.0] if isolation == "namespaces" else [-1.0, -1.0])


def test_a_command_that_fails_or_hangs_costs_its_rollout(tok, recipe_dir, caplog):
    if namespaces_problem():
        pytest.skip(namespaces_problem())
    (recipe_dir / "agent.py").write_text(
        "import json, os, sys, time\nrow = json.loads(os.environ['RLKIT_ROW'])\n"
        "if row['a'] == 12:\n    sys.exit('no tools here')\ntime.sleep(60)\n")
    t0 = time.monotonic()
    batch, _ = play(tok, recipe_dir, ROWS, timeout_s=3.0)
    assert time.monotonic() - t0 < 10
    assert batch.metrics["program/crashed"] == 1.0 and batch.metrics["program/timed_out"] == 1.0
    assert any("exit status 1: no tools here" in r.getMessage() for r in caplog.records)


# three processes beside the first, each holding 300 MiB: each within its own address-space bound
MEMORY = """import os, select, sys
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        x = bytearray(300 << 20)
        for i in range(0, len(x), 4096):
            x[i] = 1
        os.write(w, b"1"); import time; time.sleep(10); os._exit(0)
x = bytearray(300 << 20)
for i in range(0, len(x), 4096):
    x[i] = 1
got = b""
while len(got) < 3 and select.select([r], [], [], 5)[0]:
    got += os.read(r, 3)
print(float(len(got) == 3))
"""


def test_a_walled_command_holds_its_memory_in_one_cgroup(tok, recipe_dir):
    """As the code judge's samples do: its processes together hold memory_mb + 256 MiB of scratch (with
    1,200 MiB in four processes: under 2 GiB it finishes, under 512 MiB the kernel ends it)."""
    from rlkit.sandbox.cgroup import delegated

    if namespaces_problem() or delegated() is None:
        pytest.skip(namespaces_problem() or "no memory cgroup is delegated here")
    (recipe_dir / "agent.py").write_text(MEMORY)
    roomy, _ = play(tok, recipe_dir, ROWS[:1], memory_mb=2048)
    assert [s.env_reward for s in roomy.samples] == [1.0]
    tight, _ = play(tok, recipe_dir, ROWS[:1], memory_mb=512)
    assert [s.env_reward for s in tight.samples] != [1.0]


def test_what_a_command_started_ends_with_its_rollout(tok, recipe_dir):
    """Without walls too: a daemon that left the command's session (which a kill of the session
    misses) is in the command's cgroup and ends with it."""
    from rlkit.sandbox.cgroup import delegated

    if delegated() is None:
        pytest.skip("no cgroup is delegated here")
    (recipe_dir / "agent.py").write_text(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    null = os.open(os.devnull, os.O_RDWR)\n"
        "    for fd in (0, 1, 2):\n        os.dup2(null, fd)\n    if os.fork() == 0:\n"
        "        open('daemon.pid', 'w').write(str(os.getpid())); time.sleep(60)\n    os._exit(0)\n"
        "while not os.path.exists('daemon.pid'):\n    time.sleep(0.05)\nprint(1.0)\n")
    recipe_dir.chmod(0o777)
    batch, _ = play(tok, recipe_dir, ROWS[:1], isolation="process")
    assert [s.env_reward for s in batch.samples] == [1.0]
    pid = int((recipe_dir / "daemon.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


def test_a_command_that_cannot_run_is_one_line_before_launch(tok, recipe_dir):
    from rlkit.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.program.command.*'no-such-agent' is not an executable"):
        play(tok, recipe_dir, ROWS, command="no-such-agent --fast")
    with pytest.raises(ConfigError, match="command: a program is a function \\(fn\\) or a command, not both"):
        ProgramConfig(fn="a:b", command="x")


PROGRAMS = '''
from rlkit.agent.examples import calculator


def works(row, client):
    calculator(row, client)
    return 0.5


def breaks(row, client):
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "What is 1 + 2?"}])
    raise KeyError("answer")
'''


def grpo_cfg(tmp_path, program):
    from rlkit.stages import load
    from rlkit.tiny import build_tiny_model
    from rlkit.tiny_tools import write_tool_task
    from tests.helpers import ROOT

    data = write_tool_task(tmp_path / "data")
    model = build_tiny_model(tmp_path / "model", "tiny", tools=True)
    (tmp_path / "programs.py").write_text(PROGRAMS)
    overrides = [f"model.path={model}", f"data.train={data['grpo_train']}", "data.eval=null", "eval.every=0",
                 "data.template=chat", "data.build_synthetic_if_missing=null", "curriculum.enabled=false", "rewards=[]",
                 f"rollout.program.fn={tmp_path / 'programs.py'}:{program}", "rollout.max_model_len=512",
                 "rollout.max_tokens=200"]
    return load("grpo", str(ROOT / "recipes" / "tiny-grpo.yaml"), overrides), overrides


def test_the_dry_run_before_launch_runs_one_rollout_and_stops_a_broken_program(tmp_path):
    from transformers import AutoTokenizer

    from rlkit.errors import UserError
    from rlkit.grpo.dry_run import dry_run

    cfg, _ = grpo_cfg(tmp_path, "works")
    tok = AutoTokenizer.from_pretrained(cfg.model.path)  # the model's own: the engine's ids are the policy's
    lines = dry_run(cfg, str(tmp_path), Engine(tok))
    assert "2 requests, 2 turns, 0 forks, 1 tool calls; it returned 0.5" in lines[1]
    assert "The answer is" in lines[2]
    cfg, _ = grpo_cfg(tmp_path, "breaks")
    with pytest.raises(UserError, match=r"rollout.program: a dry run of one rollout \(row 1 of .*grpo_train.jsonl, "
                                        r"the base policy\) crashed: rollout 0: KeyError: 'answer'"):
        dry_run(cfg, str(tmp_path), Engine(tok))


@pytest.mark.slow
def test_print_config_runs_the_dry_run_on_a_vllm_engine(tmp_path):
    from tests.docs import run_rlkit
    from tests.helpers import ROOT

    _, overrides = grpo_cfg(tmp_path, "breaks")
    p = run_rlkit(f"rlkit grpo {ROOT / 'recipes' / 'tiny-grpo.yaml'} --print-config", tmp_path, extra=tuple(overrides))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    # the one line alone: no per-step warning saying the same, no vLLM start-up lines (they go to a log)
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("rlkit: error: rollout.program: a dry run of one rollout (row 1 of") and \
        "KeyError: 'answer'" in line
