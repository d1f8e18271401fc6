"""Every kind of object a recipe's `rewards[i].fn` may name: each scores as the contract says, or
is refused before launch in one line naming the key and what to write."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.reward import RewardError, RewardScorer, RewardSpec, resolve
from rlkit.reward.resolve import describe_rewards

KINDS = '''
import functools

def base(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]

async def coro(completions, **kwargs):
    return [2.0 * len(c) for c in completions]

def gen(completions, **kwargs):
    for c in completions:
        yield 3.0 * len(c)

async def agen(completions, **kwargs):
    for c in completions:
        yield 4.0 * len(c)

lam = lambda completions, **kwargs: [5.0 * len(c) for c in completions]
part = functools.partial(base, scale=6.0)
apart = functools.partial(coro)


class WithSetup:
    """A class: built with `args`, its setup() once before the first call."""
    calls = 0

    def __init__(self, scale=1.0):
        self.scale, self.ready = scale, 0

    def setup(self):
        self.ready += 1
        type(self).calls += 1

    def __call__(self, completions, **kwargs):
        return [self.scale * self.ready * len(c) for c in completions]


class AsyncSetup(WithSetup):
    async def setup(self):
        self.ready += 7


class Scorer:
    def __init__(self, scale=8.0):
        self.scale, self.ready = scale, 0

    def setup(self):
        self.ready = 1

    def __call__(self, completions, **kwargs):
        return [self.scale * self.ready * len(c) for c in completions]

    def score(self, completions, **kwargs):
        return [9.0 * len(c) for c in completions]

    @staticmethod
    def static(completions, **kwargs):
        return [10.0 * len(c) for c in completions]

    @classmethod
    def klass(cls, completions, **kwargs):
        return [11.0 * len(c) for c in completions]


instance = Scorer()
bound = Scorer().score
class_part = functools.partial(WithSetup, scale=12.0)

# refused
NUMBER = 3


class NoCall:
    def score(self, completions, **kwargs):
        return [1.0 for _ in completions]


class SetupTakesArgs(Scorer):
    def setup(self, model_path):
        pass


class CallIsNone:
    __call__ = None
'''

# (attribute, args, the metric name, what each character of a completion scores)
WORKS = [
    ("base", {}, "base", 1.0),
    ("base", {"scale": 2.5}, "base", 2.5),
    ("coro", {}, "coro", 2.0),
    ("gen", {}, "gen", 3.0),
    ("agen", {}, "agen", 4.0),
    ("lam", {}, "lam", 5.0),
    ("part", {}, "part", 6.0),
    ("apart", {}, "apart", 2.0),
    ("WithSetup", {"scale": 3.0}, "WithSetup", 3.0),     # setup ran once: ready == 1
    ("AsyncSetup", {}, "AsyncSetup", 7.0),                # async setup awaited
    ("class_part", {}, "class_part", 12.0),
    ("instance", {}, "instance", 8.0),                    # a module-level instance's setup() runs too
    ("instance.score", {}, "score", 9.0),
    ("bound", {}, "score", 9.0),
    ("Scorer.static", {}, "static", 10.0),
    ("Scorer.klass", {}, "klass", 11.0),
]

REFUSED = [
    ("NUMBER", r"'NUMBER' is a int, not a function, class or callable object; write `def NUMBER\(prompts, completions"),
    ("NoCall", r"class NoCall has no __call__; give it `def __call__\(self, prompts, completions, \*\*kwargs\)`"),
    ("Scorer.score", r"Scorer.score is a method of class Scorer, which needs an instance; give Scorer a `__call__` "
                     r"and name the class \(.*kinds.py:Scorer\), make score a @staticmethod"),
    ("SetupTakesArgs", r"SetupTakesArgs.setup\(model_path\) takes arguments, but setup\(\) is called with none"),
    ("CallIsNone", r"cannot read the signature of 'CallIsNone'"),
    ("Scorer.scor", r"'Scorer' has no function 'scor' \(did you mean 'score'\?\)"),
    ("Scorer.2x", r"expected 'module:function' or 'path/to/file.py:function'"),
]


@pytest.fixture
def kinds(tmp_path):
    (tmp_path / "kinds.py").write_text(KINDS)
    return tmp_path


@pytest.mark.parametrize("attr, args, name, per_char", WORKS, ids=[w[0] + ("+args" if w[1] else "") for w in WORKS])
def test_each_kind_scores_as_the_contract_says(kinds, attr, args, name, per_char):
    spec = RewardSpec(fn=f"kinds.py:{attr}", args=args)
    with RewardScorer([spec], base_dir=str(kinds)) as scorer:
        result = scorer.score(["p", "q", "r"], ["ab", "abcd", ""], None, {"answer": ["1", "2", "3"]})
        again = scorer.score(["p"], ["abc"], None, {"answer": ["1"]})
    assert scorer.names == [name]
    assert result.per_fn[name] == [2 * per_char, 4 * per_char, 0.0]
    assert again.per_fn[name] == [3 * per_char]    # a setup() ran once, not per call


@pytest.mark.parametrize("attr", ["gen", "part", "instance", "Scorer.klass"])
def test_kinds_score_in_worker_processes(kinds, attr):
    """`parallel: process` resolves the spec again in each worker: the same kinds work there."""
    with RewardScorer([RewardSpec(fn=f"kinds.py:{attr}")], base_dir=str(kinds), parallel="process") as scorer:
        result = scorer.score(["p", "q"], ["ab", "a"], None, {})
    per_char = dict((w[0], w[3]) for w in WORKS)[attr]
    assert list(result.per_fn.values()) == [[2 * per_char, per_char]]


@pytest.mark.parametrize("attr, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_other_objects_are_one_line_before_launch(kinds, attr, message):
    with pytest.raises(RewardError, match=r"^rewards\[2\]\.fn: '.*kinds.py:" + attr.replace(".", r"\.") + "' — "
                       + message) as e:
        resolve(RewardSpec(fn=f"{kinds}/kinds.py:{attr}"), None, None, key="rewards[2]")
    assert "\n" not in str(e.value)


def test_print_config_names_where_each_kind_lives(kinds):
    lines = describe_rewards([RewardSpec(fn=f"kinds.py:{a}") for a in ("part", "instance", "bound", "class_part")],
                             str(kinds))
    src = str(kinds / "kinds.py")
    numbered = list(enumerate(KINDS.splitlines(), 1))
    where = [("part", "def base"), ("instance", "class Scorer"), ("score", "    def score"),
             ("class_part", "class WithSetup")]
    for line, (name, start) in zip(lines, where, strict=True):
        source_line = next(n for n, text in numbered if text.startswith(start))  # the definition's first line
        assert f" {name}: " in line and f"-> {src}:{source_line} " in line, line


def test_the_cli_refuses_a_class_without_call_in_one_line(kinds):
    """Before: an AttributeError traceback at resolve time."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "grpo", str(root / "recipes" / "tiny-grpo.yaml"),
                          f"rewards=[{{fn: '{kinds}/kinds.py:NoCall'}}]", "--print-config"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode != 0
    err = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(err) == 1 and "rewards[0].fn:" in err[0] and "class NoCall has no __call__" in err[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout
