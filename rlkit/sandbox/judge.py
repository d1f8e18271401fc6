"""Judge model-written code: the program under test gets its code and the inputs, never an expected value.

Two kinds of test case (one kind per sample):

* ``{"input": str, "output": str}``: the code runs as ``__main__`` with that stdin in a sandbox; its
  stdout comes back and is compared here (trailing whitespace per line ignored).
* Python test code with an ``assert``, e.g. ``"assert add(2, 3) == 5"``, or a HumanEval-style
  ``def check(candidate): ...`` followed by ``check(add)``. It runs in a sandbox of its own that
  never runs the candidate's code (`rlkit.sandbox.runners`): the names the test uses freely that are
  neither builtins nor standard-library modules are the candidate's, and each call of one (an
  attribute, an item, an iteration of what it returned) is a request to the candidate's sandbox,
  which sends back only the plain data its code computed (or a reference to an object it keeps).
  Every expected value, comparison, builtin and helper of the test is computed on the tests' side;
  lists, dicts and sets a call changes in place come back changed. Builtins are the test's: a
  candidate function named like one (``pow``) is not what the test calls.

What the candidate sends back is rebuilt by exact type on the tests' side: ``None``, bool, int,
float, complex, str, bytes, and lists, tuples, sets, dicts, ``collections``' deques, Counters,
OrderedDicts and defaultdicts, Fractions and Decimals of them. An object of its own (an ``__eq__``
that says yes, a subclass of a builtin) stays on its side and cannot be compared there: the test
fails. A test form that cannot run apart from the candidate (it evaluates strings, reads the
namespace, reaches into dunder attributes or imports a module outside the standard library) is
refused when the data is checked (`check_tests`), never run with the candidate.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from rlkit.errors import RewardError
from rlkit.sandbox.programs import Outcome, Sandbox
from rlkit.sandbox.relay import converse
from rlkit.sandbox.runners import CANDIDATE, TESTS

# names whose use needs the test and the candidate in one namespace
_SHARED = {"eval", "exec", "compile", "globals", "locals", "vars", "__import__", "breakpoint"}
ROUNDS = 256  # a remote service cannot converse: each round replays a test's requests so far


class TestError(RewardError):
    """A test case that cannot run apart from the candidate's code."""


@functools.lru_cache(maxsize=4096)
def check_test(test: str) -> None:
    """Refuse (TestError, one line) an assert test that cannot run apart from the candidate's code
    (cached: every sample of a row checks the same tests; a refusal is not cached and says it again)."""
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise TestError(f"test case {test[:80]!r} is not valid Python: {e.msg}") from None
    nodes = list(ast.walk(tree))
    if not any(isinstance(n, ast.Assert) for n in nodes):
        raise TestError(f"test case {test[:80]!r} has no `assert`; write each test as `assert f(x) == expected` "
                        "(or Python code with asserts, or a list of {input, output} stdin/stdout cases)")
    for n in nodes:
        why = None
        if isinstance(n, ast.Name) and n.id in _SHARED:
            why = f"calls {n.id}()"
        elif isinstance(n, ast.Attribute) and n.attr.startswith("__"):
            why = f"reads the dunder attribute .{n.attr}"
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            why = "declares a global"
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            outside = [m for m in mods if m.split(".")[0] not in sys.stdlib_module_names]
            why = f"imports {outside[0]!r}, not a standard-library module" if outside else None
        if why:
            raise TestError(f"test case {test[:80]!r} {why}: the test runs apart from the candidate's code, "
                            "with the standard library and the candidate's functions by name only")
    if not scope_of(test)[0]:
        raise TestError(f"test case {test[:80]!r} uses no name the candidate defines: the tests' side computes it "
                        "alone, so every completion, however wrong, passes it; call the function under test in "
                        "it, or remove it")


_HELPERS = {"isclose"}  # comparison helpers a test uses by name: the test's own (math's), never the candidate's


@functools.lru_cache(maxsize=4096)
def scope_of(test: str) -> tuple[list[str], list[str], list[str]]:
    """The names ``test`` uses without binding them, as the tests' side binds them: the candidate's
    (called through it), standard-library modules it imports itself, and comparison helpers."""
    tree = ast.parse(test)
    bound, called = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            called.add(n.func.id)
    free = dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                         and n.id not in bound and not hasattr(builtins, n.id))
    helpers = [n for n in free if n in _HELPERS]
    modules = [n for n in free if n in sys.stdlib_module_names and n not in called and n not in _HELPERS]
    return [n for n in free if n not in helpers and n not in modules], modules, helpers


def check_tests(tests: list) -> None:
    """One row's test cases, as `judge` will run them: one kind, each assert test runnable apart."""
    if not tests:
        return
    if all(isinstance(t, dict) for t in tests):
        return
    if not all(isinstance(t, str) for t in tests):
        raise TestError("test cases mix assert strings and {input, output} cases; use one kind per sample")
    for t in tests:
        check_test(t)


def cases_of(column: Any) -> list | None:
    """One row's test cases from its ``test_cases`` / ``verification_info`` value: a list, or its
    JSON string, or open-r1's ``{"language", "test_cases"}`` / ``{"inputs", "outputs"}``. None: no
    cases, or not Python (not applicable)."""
    t = column
    if t is None:
        return None
    if isinstance(t, str):
        t = json.loads(t)
    if isinstance(t, dict):
        if str(t.get("language", "python")).lower() not in ("python", "python3", "py"):
            return None  # only Python runs here: not applicable
        if "test_cases" in t:
            return cases_of(t["test_cases"])
        if "inputs" in t:
            return [{"input": i, "output": o} for i, o in zip(t["inputs"], t["outputs"])]
        t = [t]
    return list(t) or None


@dataclass(frozen=True)
class Verdict:
    """One sample: tests passed of total, and whether the sandbox ended without finishing."""

    passed: int
    total: int
    timed_out: bool = False
    flooded: bool = False
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _payload(box: Sandbox, audit: bool, **cfg: Any) -> tuple[bytes, int | None]:
    """A program's first line of stdin (`Sandbox.config`), and the uid it drops to."""
    full = box.config(audit=audit, **cfg)
    return (json.dumps(full) + "\n").encode(), full["uid"]


def _run(box: Sandbox, program: str, payload: tuple[bytes, int | None], more: bytes = b"") -> Outcome:
    """One sandboxed run; a sandbox that never reached the code (not the code's doing) is an error."""
    out = box.run(program, payload[0] + more, payload[1])
    if not out.stdout.startswith(b'{"ready": true}\n') and not out.timed_out:
        raise _not_started(box, out.stderr)
    return out


def _not_started(box: Sandbox, said: str) -> RewardError:
    return RewardError(f"the code sandbox ({box.isolation}) did not start: {said or 'no message'}; "
                       "the host refused it mid-run (processes, memory, namespaces?)")


def judge(code: str, tests: list, box: Sandbox, audit: bool = True) -> Verdict:
    """Run ``code`` against ``tests`` in the sandbox (see the module doc); ``audit``: the in-process
    audit hook in the candidate's sandbox as an extra layer."""
    if not tests:
        return Verdict(0, 0)
    check_tests(tests)
    if all(isinstance(t, dict) for t in tests):
        return _judge_stdio(code, tests, box, audit)
    if box.isolation == "remote":
        return _judge_rounds(code, tests, box, audit)
    talk = converse(box, TESTS, _payload(box, True, tests=tests, scopes=[scope_of(t) for t in tests],
                                         undumpable=box.isolation == "process"), CANDIDATE,
                    _payload(box, audit, mode="serve", code=code))
    if not talk.started:
        raise _not_started(box, talk.said)
    passed = sum(talk.verdicts.get(i, {}).get("ok") is True for i in range(len(tests)))
    return Verdict(passed, len(tests), talk.timed_out, talk.flooded, talk.seconds)


def _judge_rounds(code: str, tests: list, box: Sandbox, audit: bool) -> Verdict:
    """For a service that runs one program at a time: the tests run here (a local sandbox that never
    runs the candidate's code) until each needs a reply it does not have; the service then replays
    each such test's requests in a fresh module of the candidate's. A round per sequential reply a
    test needs (at most ROUNDS), all within the sample's wall clock."""
    t0 = time.perf_counter()
    deadline = t0 + box.limits.timeout_s
    verdicts: dict[int, bool] = {}
    replies, timed_out, flooded, before = b"", False, False, None
    for _ in range(ROUNDS):
        if (left_s := deadline - time.perf_counter()) <= 0:
            timed_out = True
            break
        here = Sandbox("process", replace(box.limits, timeout_s=left_s))
        left = [i for i in range(len(tests)) if i not in verdicts]
        ran = _run(here, TESTS, _payload(here, True, tests=tests, scopes=[scope_of(t) for t in tests], replay=True,
                                         only=left, undumpable=True), replies)
        pending = {}
        for i, rec in records(ran.stdout).items():
            if "pending" in rec:
                pending[str(i)] = rec["pending"]
            elif i in left:
                verdicts[i] = rec.get("ok") is True
        if ran.timed_out or not pending or pending == before:  # done, or the service answered nothing new
            timed_out = ran.timed_out
            break
        before = pending
        there = replace(box, limits=replace(box.limits, timeout_s=max(0.1, deadline - time.perf_counter())))
        out = _run(there, CANDIDATE, _payload(there, audit, mode="replay", code=code, tests=pending))
        timed_out, flooded, replies = out.timed_out, out.flooded, out.stdout
        if timed_out or flooded:
            break
    return Verdict(sum(verdicts.values()), len(tests), timed_out, flooded, time.perf_counter() - t0)


def records(out: bytes) -> dict[int, dict]:
    """The first well-formed ``{"i": int, ...}`` record per index in what a sandbox sent."""
    got: dict[int, dict] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(rec) is dict and type(rec.get("i")) is int:
            got.setdefault(rec["i"], rec)
    return got


def _norm(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.strip().splitlines())


def _judge_stdio(code: str, tests: list[dict], box: Sandbox, audit: bool) -> Verdict:
    out = _run(box, CANDIDATE, _payload(box, audit, mode="stdio", code=code,
                                        inputs=[str(t.get("input", "")) for t in tests]))
    got = records(out.stdout)
    passed = 0
    for i, t in enumerate(tests):
        printed = got.get(i, {}).get("out")
        passed += type(printed) is str and _norm(printed) == _norm(str(t.get("output", "")))
    return Verdict(passed, len(tests), out.timed_out, out.flooded, out.seconds)
