"""Reward test fixtures: a user reward module written the TRL way, next to a recipe."""

import pytest

from rlkit.reward import RewardSpec

MODULE = '''
import asyncio, time
from rlkit.reward.contract import Failed, batch_seconds, reward_range

def exact(completions, answer, **kwargs):            # written the TRL way
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def length(completions, scale=1.0):
    return [scale * len(c) for c in completions]

def maybe(completions, **kwargs):
    return [None if c == "" else 1.0 for c in completions]

def needs_col(prompts, completions, difficulty):
    return [float(d) for d in difficulty]

async def async_len(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]

def boom(completions, **kwargs):
    return [1.0 / (len(c) - 3) for c in completions]   # raises on a 3-char completion

def batch_boom(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("batch only")
    return [1.0]

@reward_range(0.0, 1.0)
def declared(completions, **kwargs):                  # 1.0 per character: out of its range past one
    return [float(len(c)) for c in completions]

def always_boom(completions, **kwargs):
    raise RuntimeError("broken")

def short(completions, **kwargs):
    return [1.0]

def text(completions, **kwargs):
    return ["high" for _ in completions]

def nan(completions, **kwargs):
    return [float("nan") for _ in completions]

def sleepy(completions, seconds=1.0, **kwargs):
    time.sleep(seconds)
    return [1.0 for _ in completions]

@batch_seconds(lambda n, args: n * args["each"] + 1.0)
def each_sleepy(completions, each=0.2, **kwargs):  # bounds each sample itself: late ones score Failed
    time.sleep(each * len(completions))
    return [Failed(0.0, "ran past its limit") if "late" in c else 1.0 for c in completions]

def failed_or_boom(completions, **kwargs):  # a batch with "boom" raises; "late" is its own Failed
    if len(completions) > 1 and any("boom" in c for c in completions):
        raise ValueError("boom in the batch")
    if "boom" in completions[0]:
        raise ValueError("boom")
    return [Failed(0.0, "gave up") if "late" in c else 1.0 for c in completions]

def chat(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]

class Scaled:
    def __init__(self, factor):
        self.factor = factor
        self.ready = False
    def setup(self):
        self.ready = True
    def __call__(self, prompts, completions, **kwargs):
        assert self.ready
        return [self.factor * len(c) for c in completions]

NOT_CALLABLE = 3
'''


@pytest.fixture
def mod(tmp_path):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    return tmp_path


def spec(mod, fn_name, **kw):
    return RewardSpec(fn=f"{mod / 'my_rewards.py'}:{fn_name}", **kw)
