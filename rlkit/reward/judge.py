"""Judge model-written code from outside the sandbox: the program gets inputs, never expected outputs.

Two kinds of test case (one kind per sample):

* ``{"input": str, "output": str}``: the code runs as ``__main__`` with that stdin; the sandbox
  sends back its stdout and the judge compares it here (trailing whitespace per line ignored).
* a single ``assert`` statement, e.g. ``"assert add(2, 3) == 5"``. The judge splits it here into
  the parts it computes itself on plain data (comparisons, ``and``/``or``/``not``, arithmetic,
  ``abs``, ``len``, ``sorted``, ``set``, ``math.isclose``, ... and literals) and the expressions
  only code can compute (``add(2, 3)``). Each such expression is first evaluated in a sandbox
  without the candidate's code (the test's own values, e.g. ``math.sqrt(2)``: cached per test
  list); the ones that need the candidate are evaluated in its sandbox. Write expected values
  outside the candidate's calls (``f(x) == y``, ``math.isclose(f(x), y)``, ``abs(f(x) - y) < 1e-6``):
  arguments of its calls are what it sees.

Whatever comes back must be plain data, checked by exact type: ``None``, bool, int, float, str,
bytes, and lists, tuples, sets, frozensets and dicts of them. Anything else (an object with its own
``__eq__``, a subclass of a builtin) fails the test. Forged lines on the channel can only claim
outputs, which the judge still compares with values the program never saw.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import math
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkit.errors import RewardError
from rlkit.reward import sandbox
from rlkit.reward.plain import BAD, plain_frozenset, plain_set, records, sent_values
from rlkit.reward.sandbox import Sandbox

# Runs in the sandbox. stdin line 1: JSON {limits, uid, audit, mode, code, exprs | inputs}. Sends one
# JSON line per expression ({"i", "v"} or {"i", "error"}) or per input ({"i", "out"} or {"i", "error"}).
RUNNER = r"""
import io, json, os, resource, sys
cfg = json.loads(sys.stdin.readline())
for name, v in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (v, v))
if cfg["uid"] is not None:
    u = cfg["uid"]
    os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
res = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
res.write('{"ready": true}\n'); res.flush()
cwd = os.path.realpath(os.getcwd()) + os.sep
def inside(p):
    try:
        return os.path.realpath(os.fsdecode(p)).startswith(cwd)
    except Exception:
        return False
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
BLOCK = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
         "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
         "os.chown", "os.setuid", "sys.addaudithook", "pty.spawn", "os.startfile"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.link", "os.symlink",
         "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
def hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        if isinstance(path, int):
            return
        w = (isinstance(mode, str) and any(m in mode for m in "wax+")) or (isinstance(flags, int) and flags & WRITE)
        if w and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory")
    elif event in BLOCK:
        raise PermissionError("sandbox: " + event + " is not allowed")
    elif event in PATHS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not inside(args[0]):
        raise PermissionError("sandbox: " + event + " outside the working directory")
def send(obj):
    res.write(json.dumps(obj) + "\n"); res.flush()
PLAIN = (type(None), bool, int, str)
def enc(v, depth=0):
    t = type(v)
    if depth > 64:
        raise ValueError("nested too deep")
    if t in PLAIN:
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"float": repr(v)}
    if t is list:
        return [enc(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    raise TypeError("not plain data: " + t.__name__)
class Stdlib(dict):
    def __init__(self, g):
        self.g = g
    def __missing__(self, name):
        if name not in self.g and name in sys.stdlib_module_names:
            return __import__(name)
        raise KeyError(name)
code = cfg["code"]
if cfg["audit"]:
    sys.addaudithook(hook)
try:
    compiled = compile(code, "solution.py", "exec")
except BaseException:
    compiled = None
if cfg["mode"] == "stdio":
    for i, given in enumerate(cfg["inputs"]):
        buf = io.StringIO()
        sys.stdin, sys.stdout = io.StringIO(given), buf
        try:
            if compiled is None:
                raise SyntaxError
            try:
                exec(compiled, {"__name__": "__main__"})
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            send({"i": i, "out": buf.getvalue()})
        except BaseException as e:
            send({"i": i, "error": type(e).__name__})
else:
    g = {"__name__": "solution"}
    try:
        exec(compiled, g)
        ok = compiled is not None
    except BaseException:
        ok = False
    for i, src in enumerate(cfg["exprs"]):
        try:
            if not ok:
                raise RuntimeError("the code did not run")
            send({"i": i, "v": enc(eval(src, g, Stdlib(g)))})
        except BaseException as e:
            send({"i": i, "error": type(e).__name__})
"""

_CMP: dict[str, Callable[[Any, Any], Any]] = {
    "Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
    "GtE": operator.ge, "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b, "Is": operator.is_,
    "IsNot": operator.is_not}
_BIN: dict[str, Callable[[Any, Any], Any]] = {
    "Add": operator.add, "Sub": operator.sub, "Mult": operator.mul, "Div": operator.truediv,
    "FloorDiv": operator.floordiv, "Mod": operator.mod}
_CALLS: dict[str, Callable[..., Any]] = {
    "abs": abs, "len": len, "sorted": sorted, "set": plain_set, "frozenset": plain_frozenset, "tuple": tuple,
    "list": list,
    "round": round, "min": min, "max": max, "sum": sum, "all": all, "any": any, "bool": bool, "int": int,
    "float": float, "str": str, "isclose": math.isclose, "math.isclose": math.isclose}


class TestError(RewardError):
    """A test case the judge cannot split into what it computes and what the code computes."""


@dataclass(frozen=True)
class Check:
    """One assert test: ``tree`` is what the judge computes; its ("side", k) leaves are expressions
    evaluated in a sandbox (``sides[k]``)."""

    tree: tuple
    sides: tuple[str, ...]


def parse_assert(test: str) -> Check:
    """Split ``assert EXPR`` into the judge's part and the sandbox's expressions."""
    try:
        body = ast.parse(test).body
    except SyntaxError as e:
        raise TestError(f"test case {test!r} is not valid Python: {e.msg}") from None
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise TestError(f"test case {test!r} is not one `assert` statement; the judge compares outside the "
                        "sandbox, so write each test as `assert f(x) == expected` (or a list of "
                        "{input, output} stdin/stdout cases)")
    sides: list[str] = []
    return Check(_plan(body[0].test, sides), tuple(sides))


def _plan(node: ast.expr, sides: list[str]) -> tuple:
    try:
        return ("const", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Compare):
        return ("cmp", tuple(type(op).__name__ for op in node.ops),
                tuple(_plan(n, sides) for n in (node.left, *node.comparators)))
    if isinstance(node, ast.BoolOp):
        return ("and" if isinstance(node.op, ast.And) else "or", tuple(_plan(v, sides) for v in node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
        return (type(node.op).__name__, _plan(node.operand, sides))
    if isinstance(node, ast.BinOp) and type(node.op).__name__ in _BIN:
        return ("bin", type(node.op).__name__, _plan(node.left, sides), _plan(node.right, sides))
    if isinstance(node, ast.Call) and ast.unparse(node.func) in _CALLS \
            and not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords):
        try:
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError):
            kwargs = None
        if kwargs is not None:
            return ("call", ast.unparse(node.func), tuple(_plan(a, sides) for a in node.args), kwargs)
    src = ast.unparse(node)
    if src not in sides:
        sides.append(src)
    return ("side", sides.index(src))


def evaluate(tree: tuple, values: dict[int, Any]) -> Any:
    """The judge's part of a check, on plain data (a missing side raises KeyError)."""
    kind = tree[0]
    if kind == "const":
        return tree[1]
    if kind == "side":
        return values[tree[1]]
    if kind == "cmp":
        vals = [evaluate(t, values) for t in tree[2]]
        return all(_CMP[op](a, b) for op, a, b in zip(tree[1], vals, vals[1:]))
    if kind == "and":
        return all(evaluate(t, values) for t in tree[1])
    if kind == "or":
        return any(evaluate(t, values) for t in tree[1])
    if kind == "Not":
        return not evaluate(tree[1], values)
    if kind in ("USub", "UAdd"):
        v = _number(evaluate(tree[1], values))
        return -v if kind == "USub" else v
    if kind == "bin":
        return _BIN[tree[1]](_number(evaluate(tree[2], values)), _number(evaluate(tree[3], values)))
    return _CALLS[tree[1]](*(evaluate(t, values) for t in tree[2]), **tree[3])


def _number(v: Any) -> int | float:
    if type(v) not in (int, float, bool):  # no str * int blow-ups in the judge
        raise TypeError("arithmetic on numbers only")
    return v


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


def _payload(box: Sandbox, audit: bool, mode: str, code: str, items: list) -> bytes:
    uid = sandbox.next_uid() if box.isolation == "namespaces" and sandbox.running_as_root() else None
    cfg = {"limits": box.limits.rlimits(), "uid": uid, "audit": audit, "mode": mode, "code": code,
           "exprs" if mode == "exprs" else "inputs": items}
    return (json.dumps(cfg) + "\n").encode()


def _run(code: str, mode: str, items: list, box: Sandbox, audit: bool) -> sandbox.Outcome:
    """One sandboxed run; a sandbox that never reached the code (not the code's doing) is an error."""
    out = box.run(RUNNER, _payload(box, audit, mode, code, items))
    if not out.stdout.startswith(b'{"ready": true}\n') and not out.timed_out:
        raise RewardError(f"the code sandbox ({box.isolation}) did not start: {out.stderr or 'no message'}; "
                          "the host refused it mid-run (processes, memory, namespaces?)")
    return out


_trusted: dict[str, dict[str, Any]] = {}
_trusted_lock = threading.Lock()  # one reference run at a time: a run's first step, then cached


def trusted_values(sides: list[str], box: Sandbox) -> dict[str, Any]:
    """The sides a test computes without the candidate (its expected values), evaluated once in a
    sandbox with no candidate code; cached per list of sides."""
    if not sides:
        return {}
    key = hashlib.sha256(json.dumps(sides).encode()).hexdigest()
    with _trusted_lock:
        if key in _trusted:
            return _trusted[key]
        vals = sent_values(_run("", "exprs", sides, box, audit=True), sides)
        if len(_trusted) > 4096:
            _trusted.clear()
        _trusted[key] = vals
        return vals


def judge(code: str, tests: list, box: Sandbox, audit: bool = True) -> Verdict:
    """Run ``code`` against ``tests`` in the sandbox and compare here (see the module doc)."""
    if not tests:
        return Verdict(0, 0)
    if all(isinstance(t, dict) for t in tests):
        return _judge_stdio(code, tests, box, audit)
    if not all(isinstance(t, str) for t in tests):
        raise TestError("test cases mix assert strings and {input, output} cases; use one kind per sample")
    checks = [parse_assert(t) for t in tests]
    sides = list(dict.fromkeys(s for c in checks for s in c.sides))
    trusted = trusted_values(sides, box)
    asked = [s for s in sides if s not in trusted]
    out = _run(code, "exprs", asked, box, audit) if asked else None
    values = {**trusted, **(sent_values(out, asked) if out else {})}
    passed = 0
    for c in checks:
        with contextlib.suppress(*BAD):
            passed += bool(evaluate(c.tree, {k: values[s] for k, s in enumerate(c.sides) if s in values}))
    return Verdict(passed, len(tests), bool(out and out.timed_out), bool(out and out.flooded),
                   out.seconds if out else 0.0)


def _norm(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.strip().splitlines())


def _judge_stdio(code: str, tests: list[dict], box: Sandbox, audit: bool) -> Verdict:
    out = _run(code, "stdio", [str(t.get("input", "")) for t in tests], box, audit)
    got = records(out.stdout)
    passed = 0
    for i, t in enumerate(tests):
        printed = got.get(i, {}).get("out")
        passed += type(printed) is str and _norm(printed) == _norm(str(t.get("output", "")))
    return Verdict(passed, len(tests), out.timed_out, out.flooded, out.seconds)
