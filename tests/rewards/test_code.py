"""rewards.code: scoring, the judge outside the sandbox (the program never sees an expected value;
only plain data comes back), the refusal to run without the sandbox's walls. What the sandbox
contains is `test_sandbox_attacks.py`."""

import http.server
import json
import math
import threading
import time

import pytest

from rewards.code import code_reward, extract_code, run_tests
from rlkit.errors import RewardError
from rlkit.reward import RewardScorer, RewardSpec
from rlkit.sandbox import judge, relay, walls
from rlkit.sandbox import programs as sandbox

needs_sandbox = pytest.mark.skipif(sandbox.namespaces_problem() is not None,
                                   reason=f"no sandbox here: {sandbox.namespaces_problem()}")

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'", "assert add(2, 2) == 5"]


def fenced(code):
    return f"Here you go:\n```python\n{code}\n```\nDone."


def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("no code") == ""
    assert extract_code([{"role": "assistant", "content": "```python\nq = 1\n```"}]) == "q = 1\n"


@needs_sandbox
def test_fraction_of_tests_passed():
    good = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return a - b")
    got = code_reward([good, wrong, "no code", good, fenced("def add(a, b) return")],
                      [ADD_TESTS, ADD_TESTS, ADD_TESTS, None, ADD_TESTS])
    # good: 3 of 4 (the last test is wrong on purpose); wrong: only add(-1, 1)... = -2 != 0 -> 0 of 4
    assert got == [0.75, 0.0, 0.0, None, 0.0]


@needs_sandbox
def test_stdio_tests_and_json_column():
    prog = fenced("n = int(input())\nprint(n * 2)\nprint('完成')")
    tests = json.dumps([{"input": "3", "output": "6\n完成"}, {"input": "5", "output": "10\n完成  \n"},
                        {"input": "1", "output": "3\n完成"}])
    assert code_reward([prog], [tests]) == [pytest.approx(2 / 3)]
    verification = {"test_cases": [{"input": "2\n", "output": "4\n完成", "type": "stdin_stdout"}]}
    assert code_reward([prog], [verification]) == [1.0]


@needs_sandbox
def test_open_r1_verification_info_column():
    """open-r1's code datasets name the column `verification_info` (a JSON string per row)."""
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


@needs_sandbox
def test_environment_is_clean_and_workdir_writable(monkeypatch):
    monkeypatch.setenv("RLKIT_TEST_SECRET", "hunter2")
    code = ("import os\nopen('scratch.txt', 'w').write('ok')\n"
            "def env(): return sorted(os.environ)\ndef scratch(): return open('scratch.txt').read()\n"
            "def home(): return os.environ['HOME'] == os.getcwd()")
    tests = ["assert 'RLKIT_TEST_SECRET' not in env()", "assert scratch() == 'ok'", "assert home()"]
    assert run_tests(code, tests).passed == 3


@needs_sandbox
def test_the_program_never_sees_an_expected_value(monkeypatch):
    """The candidate's sandbox gets its code and the requests for its calls; the tests, their
    expected values and every comparison stay in the other sandbox, which never runs its code."""
    sent = {}
    real = relay.converse

    def spy(box, tests, tests_payload, candidate, candidate_payload):
        sent.update(tests=tests_payload[0].decode(), candidate=candidate_payload[0].decode())
        return real(box, tests, tests_payload, candidate, candidate_payload)
    monkeypatch.setattr(judge, "converse", spy)
    code = "import math\ndef root(x):\n    return math.sqrt(x)\ndef pair(): return (1, 'EXPECTED-7f3a')"
    tests = ["assert root(2) == math.sqrt(2)", "assert pair() == (1, 'EXPECTED-7f3a')",
             "assert abs(root(9) - 3) < 1e-9 and not root(4) == 3"]
    assert run_tests(code, tests).passed == 3
    candidate = json.loads(sent["candidate"])
    assert candidate["code"] == code and candidate["mode"] == "serve" and "tests" not in candidate
    rest = {k: v for k, v in candidate.items() if k != "code"}
    assert "EXPECTED-7f3a" not in json.dumps(rest) and "EXPECTED-7f3a" in sent["tests"]
    assert json.loads(sent["tests"])["tests"] == tests and "root(x)" not in sent["tests"]


HONEST = {name: form for name, form in zip([
    "counter", "generator-startswith-operator-pow", "big-int", "class", "humaneval-check", "in-place", "exception",
    "iterator", "callback", "number-types", "linked-list", "plain-subclasses"], [
    ("from collections import Counter\ndef f(s): return Counter(s)",
     ["assert f('abca') == Counter('abca')", "assert f('ab') == collections.Counter({'a': 1, 'b': 1})"]),
    ("def f(x): return x * 2", ["assert all(f(x) == 2 * x for x in range(12))", "assert f('ab').startswith('aba')",
                                "assert operator.eq(f(3), 6)", "assert pow(f(2), 10) == 1048576"]),
    ("def big(): return 10 ** 5000 + 7", ["assert big() == 10 ** 5000 + 7", "assert big() % 10 == 7"]),
    ("class Solution:\n    def two(self, a, t):\n        seen = {}\n        for i, x in enumerate(a):\n"
     "            if t - x in seen: return [seen[t - x], i]\n            seen[x] = i",
     ["assert Solution().two([2, 7, 11], 9) == [0, 1]", "s = Solution()\nassert s.two([3, 3], 6) == [0, 1]"]),
    ("def add(a, b): return a + b", ["def check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)"]),
    ("def srt(xs): xs.sort()", ["x = [3, 1, 2]\nsrt(x)\nassert x == [1, 2, 3]"]),
    ("def inv(x):\n    if x == 0: raise ValueError('zero')\n    return 1 / x",
     ["try:\n    inv(0)\n    assert False\nexcept ValueError:\n    pass", "assert inv(4) == 0.25"]),
    ("def gen(n):\n    for i in range(n): yield i * i",
     ["assert list(gen(4)) == [0, 1, 4, 9]", "g = gen(3)\nassert next(g) == 0 and next(g) == 1"]),
    ("def app(f, x): return f(x) + 1", ["assert app(lambda v: v * 10, 2) == 21", "assert app(abs, -3) == 4"]),
    ("from fractions import Fraction\ndef fr(): return Fraction(1, 3), 1 + 2j, b'xy', frozenset([3])",
     ["assert fr() == (Fraction(1, 3), 1 + 2j, b'xy', frozenset([3]))"]),
    ("class Node:\n    def __init__(self, v, nxt=None): self.v, self.nxt = v, nxt\ndef build(xs):\n    h = None\n"
     "    for x in reversed(xs): h = Node(x, h)\n    return h\ndef to_list(h):\n    out = []\n    while h:\n"
     "        out.append(h.v); h = h.nxt\n    return out\ndef rev(h):\n    p = None\n"
     "    while h: h.nxt, p, h = p, h, h.nxt\n    return p",
     ["assert to_list(rev(build([1, 2, 3]))) == [3, 2, 1]", "assert build([5]).v == 5"]),
    # subclasses of plain data come back as that data (a namedtuple keeps its fields), their methods run here
    ("import collections, enum\nP = collections.namedtuple('P', 'x y')\nclass C(enum.IntEnum):\n    RED = 1\n"
     "class S(str): pass\ndef pt(): return P(1, 2)\ndef col(): return C.RED\ndef s(): return S('ab')",
     ["assert pt().x == 1 and pt() == (1, 2)", "assert col() == 1", "assert s().startswith('a') and s() == 'ab'"])])}


@needs_sandbox
@pytest.mark.parametrize("isolation", ["namespaces", "process"])
@pytest.mark.parametrize("form", list(HONEST))
def test_an_honest_solution_passes_every_test_form(form, isolation):
    """What the tests' side computes (a Counter, a generator inside all(), .startswith, operator.eq,
    pow, a 5001-digit int) and what crosses (objects kept on the candidate's side, arguments changed
    in place, exceptions, iterators, a function of the test's called back)."""
    code, tests = HONEST[form]
    assert run_tests(code, tests, isolation=isolation).passed == len(tests)


@needs_sandbox
@pytest.mark.parametrize("returned, expected, passes", [
    ("(1, 2)", "(1, 2)", True), ("[1, 2]", "(1, 2)", False), ("{3, 1}", "{1, 3}", True),
    ("{'a': [1, (2,)]}", "{'a': [1, (2,)]}", True), ("b'xy'", "b'xy'", True), ("None", "None", True),
    ("float('nan')", "float('nan')", False), ("True", "1", True), ("range(3)", "range(3)", False),
    ("type('S', (str,), {'__eq__': lambda a, b: True, '__hash__': str.__hash__})('x')", "'x'", True),
    ("type('S', (str,), {'__eq__': lambda a, b: True, '__hash__': str.__hash__})('x')", "'y'", False),
    ("object()", "None", False),
])
def test_only_plain_data_comes_back(returned, expected, passes):
    """Values come back by exact type (an object, a range: the test fails; a str subclass as the str it
    holds, its own `__eq__` left behind) and keep what Python's == tells apart (a tuple is not a list)."""
    got = run_tests(f"def f():\n    return {returned}", [f"assert f() == {expected}"])
    assert got.passed == int(passes)


@needs_sandbox
def test_a_test_the_judge_cannot_split_is_one_line():
    with pytest.raises(judge.TestError, match=r"test case 'check\(f\)' has no `assert`"):
        run_tests("def f(): pass", ["check(f)"])
    for test, why in [("assert eval('f()') == 1", "calls eval()"), ("assert f.__name__ == 'f'", "dunder attribute"),
                      ("from solution import f\nassert f() == 1", "imports 'solution', not a standard-library"),
                      ("assert globals()['f']() == 1", "calls globals()"),
                      # computed on the tests' side alone: any completion, however wrong, would pass it
                      ("assert pow(2, 3) == 8", "uses no name the candidate defines"),
                      ("assert hex(255) == '0xff'", "uses no name the candidate defines"),
                      ("import math\nassert math.isqrt(9) == 3", "uses no name the candidate defines")]:
        with pytest.raises(judge.TestError, match=why):
            run_tests("def f(): return 1", [test])
    with pytest.raises(judge.TestError, match="mix assert strings and"):
        run_tests("def f(): pass", ["assert f() is None", {"input": "", "output": ""}])


@needs_sandbox
def test_a_run_killed_before_every_test_reported_scores_on_crash():
    loop = fenced("import time\ndef add(a, b):\n    return a + b\ndef slow():\n    while True: pass")
    tests = ["assert add(1, 2) == 3", "assert slow() == 1"]
    assert code_reward([loop], [tests], timeout_s=1.0) == [0.0]
    assert code_reward([loop], [tests], timeout_s=1.0, on_crash=None) == [None]
    assert run_tests(extract_code(loop), tests, timeout_s=1.0).passed == 1  # what finished still counts
    assert code_reward([fenced("def add(a, b):\n    return a + b")], [tests[:1]], on_crash=None) == [1.0]


@needs_sandbox
def test_values_that_hash_alike_cost_the_sample_never_the_driver():
    """A forged reply of 40,000 ints equal modulo 2**61 - 1 (one hash) makes rebuilding its set
    quadratic (seconds of CPU): the tests' sandbox pays it, within the sample's wall clock, and the
    test fails; the driver never decodes what the candidate sends. Values that hash alike honestly
    still make their set."""
    forged = ("import sys\nM = 2**61 - 1\nrunner = sys.modules['__main__']\n"
              "runner.enc = lambda v, keep, depth=0: {'set': [i * M for i in range(40000)]}\ndef f(): return 0")
    cpu, t0 = time.process_time(), time.perf_counter()
    got = run_tests(forged, ["assert len(f()) == 40000"], timeout_s=1.0)
    assert got.passed == 0 and time.perf_counter() - t0 < 3.0 and time.process_time() - cpu < 0.5
    fair = "def g():\n    return [1] * 1000 + [2, 2**61 + 1, 2 * 2**61]"  # 2**61 + 1 hashes as 2**61 - 1's 2
    assert run_tests(fair, ["assert set(g()) == {1, 2, 2**61 + 1, 2 * 2**61}", "assert len(set(g())) == 4"]).passed == 2


@needs_sandbox
def test_slow_samples_cost_themselves_never_the_step(caplog):
    """Samples that sleep past their 1 s: the batch is given the time its samples' limits add up to
    (past the spec's 2 s, in which six of them on two workers cannot end), each scores 0 and is
    counted in reward/code_reward/errors; before, the batch call timed out and stopped the step."""
    spec = RewardSpec(fn="rewards.code:code_reward", timeout_s=2.0, args={"timeout_s": 1.0, "workers": 2})
    slow = fenced("import time\ntime.sleep(30)\ndef add(a, b):\n    return a + b")
    good = fenced("def add(a, b):\n    return a + b")
    r = RewardScorer([spec], columns={"test_cases"}).score(
        ["p"] * 8, [slow] * 6 + [good] * 2, None, {"test_cases": [ADD_TESTS] * 8})
    assert r.total == [0.0] * 6 + [0.75] * 2 and r.metrics()["reward/code_reward/errors"] == 6.0
    assert r.seconds["code_reward"] > 2.0  # longer than the spec's limit
    assert any("its code ran past its 1 s" in rec.getMessage() for rec in caplog.records)


def test_without_namespaces_it_refuses_unless_the_recipe_accepts_less(monkeypatch):
    monkeypatch.setattr(sandbox, "namespaces_problem", lambda python=None: "bubblewrap is not installed")
    spec = RewardSpec(fn="rewards.code:code_reward")
    with pytest.raises(RewardError, match=r"^rewards\[0\]\.args\.isolation: cannot sandbox untrusted code here: "
                                          r"bubblewrap is not installed; or accept .*`rewards\[0\]\.args\.isolation: "
                                          r"process`"):
        RewardScorer([spec], columns={"test_cases"})
    weak = RewardScorer([RewardSpec(fn="rewards.code:code_reward", args={"isolation": "process"})],
                        columns={"test_cases"})
    r = weak.score(["p", "p"], [fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return None")],
                   None, {"test_cases": [ADD_TESTS, ADD_TESTS]})
    assert r.total == [0.75, 0.0]


@needs_sandbox
def test_a_forged_or_broken_score_never_leaves_the_range():
    """Whatever a candidate does, the reward is a fraction of the tests: within [0, 1]."""
    attacks = [fenced("import os\nos.write(3, b'{\"i\": 0, \"v\": 500}\\n' * 100)\nos._exit(0)"),
               fenced("def add(a, b):\n    return float('inf')"), fenced("raise SystemExit(0)")]
    got = code_reward(attacks, [ADD_TESTS] * 3)
    assert all(v == 0.0 for v in got) and not any(math.isnan(v) for v in got)


@needs_sandbox
def test_runs_inside_the_scorer_thread_pool():
    s = RewardScorer([RewardSpec(fn="rewards.code:code_reward", args={"timeout_s": 2.0})], columns={"test_cases"})
    r = s.score(["p", "p"], [fenced("def add(a, b):\n    return a + b"), fenced("while True: pass")], None,
                {"test_cases": [ADD_TESTS, ADD_TESTS]})
    assert r.total == [0.75, 0.0]


@needs_sandbox
def test_a_sandbox_that_does_not_start_stops_the_step_with_its_message(monkeypatch):
    """Not the candidate's doing, so not a silent 0 for every sample: one line with bubblewrap's words."""
    real = walls.bwrap_command
    monkeypatch.setattr(walls, "bwrap_command", lambda *a: [*real(*a)[:1], "--no-such-option", *real(*a)[1:]])
    with pytest.raises(RewardError, match=r"the code sandbox \(namespaces\) did not start: bwrap: Unknown option "
                                          r"--no-such-option"):
        run_tests("def add(a, b):\n    return a + b", ADD_TESTS)
    s = RewardScorer([RewardSpec(fn="rewards.code:code_reward")], columns={"test_cases"})
    with pytest.raises(RewardError, match=r"rewards\[0\] 'code_reward' raised RewardError: the code sandbox"):
        s.score(["p", "q"], [fenced("def add(a, b):\n    return a + b")] * 2, None, {"test_cases": [ADD_TESTS] * 2})


def test_words_written_after_the_output_closed_are_still_kept():
    """bubblewrap may close stdout before its refusal reaches stderr: the message is read, not raced."""
    box = sandbox.Sandbox("process", sandbox.Limits(timeout_s=5.0))
    out = box.run("import os, sys, time\nos.close(1)\ntime.sleep(0.3)\nsys.stderr.write('late words')", b"")
    assert out.stdout == b"" and out.stderr == "late words" and not out.timed_out


class SandboxFusion(http.server.BaseHTTPRequestHandler):
    """A stand-in for a SandboxFusion service's `POST /run_code`, running each request in this
    machine's bubblewrap sandbox; it counts what it was sent."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 — http.server's name
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SandboxFusion.seen.append(req)
        box = sandbox.Sandbox("namespaces", sandbox.Limits(timeout_s=req["run_timeout"]))
        out = box.run(req["code"], req["stdin"].encode())
        body = json.dumps({"status": "Success", "run_result": {
            "status": "TimeLimitExceeded" if out.timed_out else "Finished", "stdout": out.stdout.decode(),
            "stderr": out.stderr, "return_code": 0}}).encode()
        self.send_response(404 if self.path != "/run_code" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fusion():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SandboxFusion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SandboxFusion.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@needs_sandbox
def test_a_remote_sandboxfusion_service_runs_the_code_and_the_judge_stays_here(fusion):
    """`isolation: remote` sends the program and the inputs to the service; the expected values never
    leave, so a forged reply from inside the service's sandbox scores nothing either."""
    args = {"isolation": "remote", "sandbox_url": fusion}
    s = RewardScorer([RewardSpec(fn="rewards.code:code_reward", args=args)], columns={"test_cases"})
    forged = fenced("import os\nos.write(3, b'{\"i\": 0, \"v\": 3}\\n')\nos._exit(0)")
    r = s.score(["p"] * 3, [fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return None"),
                            forged], None, {"test_cases": [ADD_TESTS] * 3})
    assert r.total == [0.75, 0.0, 0.0]  # a forged line is no reply to any request
    assert SandboxFusion.seen and all(req["language"] == "python" for req in SandboxFusion.seen)
    assert not any("== 5" in req["stdin"] or "'ab'" in req["stdin"] for req in SandboxFusion.seen)
    stdio = [{"input": "4", "output": "8"}, {"input": "5", "output": "11"}]
    assert code_reward([fenced("print(int(input()) * 2)")], [stdio], **args) == [0.5]
    # the tests run here and the service replays each test's requests (a round per reply a test
    # needs in sequence: 12 for all() over 12 inputs): every form but a function of the test's,
    # which the candidate cannot call back
    for form, (code, tests) in HONEST.items():
        assert run_tests(code, tests, **args).passed == (0 if form == "callback" else len(tests)), form


def test_a_remote_service_that_does_not_answer_is_one_line_before_launch():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = {"isolation": "remote", "sandbox_url": f"http://127.0.0.1:{port}"}
    with pytest.raises(RewardError, match=r"^rewards\[0\]\.args\.sandbox_url: the remote sandbox "
                                          rf"http://127.0.0.1:{port}/run_code did not answer: .*refused"):
        RewardScorer([RewardSpec(fn="rewards.code:code_reward", args=args)], columns={"test_cases"})
    with pytest.raises(RewardError, match=r"rewards\[0\]\.args\.sandbox_url: `rewards\[0\]\.args\.isolation: "
                                          r"remote` needs the service's http\(s\) URL, got None"):
        RewardScorer([RewardSpec(fn="rewards.code:code_reward", args={"isolation": "remote"})],
                     columns={"test_cases"})
