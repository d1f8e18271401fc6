"""rewards.code: scoring and sandbox containment (infinite loop, fork bomb, memory, network,
writes outside the working directory), with and without the in-process audit hook."""

import json
import os
import socket
import time
import uuid

import pytest

from rewards.code import _UID_BASE, code_reward, extract_code, run_tests

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'", "assert add(2, 2) == 5"]


def fenced(code):
    return f"Here you go:\n```python\n{code}\n```\nDone."


def sandbox_processes():
    """Live processes running under a sandbox uid, or children of this test process (other than
    Python's multiprocessing resource tracker, which a spawn pool of an earlier test leaves for
    the life of this process)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        if uid >= _UID_BASE or (int(fields["PPid"]) == os.getpid() and fields.get("State", "").split()[0] != "Z"):
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()[:150]
            if uid < _UID_BASE and "multiprocessing.resource_tracker" in cmdline:
                continue
            left.append((pid, fields["Name"].strip(), fields["State"].strip(), uid, cmdline))
    return left


def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("no code") == ""
    assert extract_code([{"role": "assistant", "content": "```python\nq = 1\n```"}]) == "q = 1\n"


def test_fraction_of_tests_passed():
    good = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return a - b")
    got = code_reward([good, wrong, "no code", good, fenced("def add(a, b) return")],
                      [ADD_TESTS, ADD_TESTS, ADD_TESTS, None, ADD_TESTS])
    # good: 3 of 4 (the last test is wrong on purpose); wrong: only add(-1, 1)... = -2 != 0 -> 0 of 4
    assert got == [0.75, 0.0, 0.0, None, 0.0]


def test_stdio_tests_and_json_column():
    prog = fenced("n = int(input())\nprint(n * 2)\nprint('完成')")
    tests = json.dumps([{"input": "3", "output": "6\n完成"}, {"input": "5", "output": "10\n完成  \n"},
                        {"input": "1", "output": "3\n完成"}])
    assert code_reward([prog], [tests]) == [pytest.approx(2 / 3)]
    verification = {"test_cases": [{"input": "2\n", "output": "4\n完成", "type": "stdin_stdout"}]}
    assert code_reward([prog], [verification]) == [1.0]


def test_open_r1_verification_info_column():
    """open-r1's code datasets name the column `verification_info` (a JSON string per row)."""
    from rlkit.errors import RewardError
    from rlkit.reward import RewardScorer, RewardSpec

    prog = fenced("a, b = map(int, input().split())\nprint(a + b)")
    cases = [{"input": "1 2\n", "output": "3\n", "type": "stdin_stdout"},
             {"input": "5 5\n", "output": "11\n", "type": "stdin_stdout"}]
    info = [json.dumps({"language": "python", "test_cases": cases}),
            json.dumps({"language": "cpp", "test_cases": [{"input": "1 2\n", "output": "3\n"}]})]
    assert code_reward([prog, prog], verification_info=info) == [0.5, None]  # only Python runs here
    s = RewardScorer([RewardSpec(fn="rewards.code:code_reward")], columns={"prompt", "verification_info"})
    assert s.score(["p"], [prog], None, {"verification_info": info[:1]}).total == [0.5]
    # a dataset with neither column is an error before launch, naming both
    with pytest.raises(RewardError, match=r"rewards\[0\]: code_reward needs one of 'test_cases', 'verification_info' "
                                          r"— not a dataset column \(columns: answer, prompt\)"):
        RewardScorer([RewardSpec(fn="rewards.code:code_reward")], columns={"prompt", "answer"})


def test_environment_is_clean_and_workdir_writable(monkeypatch):
    monkeypatch.setenv("RLKIT_TEST_SECRET", "hunter2")
    code = "import os\nopen('scratch.txt', 'w').write('ok')\n"
    tests = ["assert 'RLKIT_TEST_SECRET' not in os.environ", "assert open('scratch.txt').read() == 'ok'",
             "assert os.environ['HOME'] == os.getcwd()"]
    assert run_tests(code, tests).passed == 3


ATTACKS = {
    "infinite_loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "large_allocation": "x = bytearray(8 * 1024 ** 3)\ny = [0] * (10 ** 9)",
    "socket_connect": "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                      "s.sendall(b'pwned')",
    "write_outside": "for p in {paths!r}:\n    try:\n        open(p, 'w').write('pwned')\n    except OSError:\n"
                     "        pass\nraise SystemExit(1)",
}


@pytest.mark.parametrize("audit", [True, False], ids=["audit_hook", "os_only"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_containment(attack, audit, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    outside = [str(tmp_path / "escaped.txt"), f"/tmp/rlkit-escape-{uuid.uuid4().hex}.txt",
               f"/dev/shm/rlkit-escape-{uuid.uuid4().hex}"]
    code = ATTACKS[attack].format(port=server.getsockname()[1], paths=outside)
    t0 = time.perf_counter()
    res = run_tests(code, ["assert True"], timeout_s=2.0, audit=audit)
    elapsed = time.perf_counter() - t0
    assert res.score == 0.0
    assert elapsed < 6.0, elapsed
    if attack == "infinite_loop":
        assert res.timed_out
    assert sandbox_processes() == []
    assert not any(os.path.exists(p) for p in outside)
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_runs_inside_the_scorer_thread_pool():
    from rlkit.reward import RewardScorer, RewardSpec

    s = RewardScorer([RewardSpec(fn="rewards.code:code_reward", args={"timeout_s": 2.0})], columns={"test_cases"})
    r = s.score(["p", "p"], [fenced("def add(a, b):\n    return a + b"), fenced("while True: pass")], None,
                {"test_cases": [ADD_TESTS, ADD_TESTS]})
    assert r.total == [0.75, 0.0]
