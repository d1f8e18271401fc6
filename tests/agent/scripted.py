"""What the agent tests share: a scripted engine that answers with tool calls, the rows it is asked
about, the check that a sample's tokens are exactly the engine's, and a user's tools file."""

from __future__ import annotations

import re
import time

from rlkit.rollout.samples import Sample

CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'

class Engine:
    """Answers a prompt whose last turn is a user's with a call of `add` on the question's numbers,
    and one after a tool result with "The answer is R"; logprobs distinct per call and token.
    Records every call (prompts and the samples it gave)."""

    def __init__(self, tok, delay=0.0):
        self.tok, self.delay, self.calls = tok, delay, []

    def generate(self, prompts, n, sampling, seed):
        time.sleep(self.delay)
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            last = text.rsplit("<|im_start|>", 2)[-2]
            if "<tool_response>" not in last:
                a, b = [int(x) for x in re.findall(r"\d+", last)][:2]
                reply = CALL.format(a=a, b=b)
            else:
                result = last.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
                reply = f"The answer is {result}<|im_end|>"
            ids = self.tok(reply, add_special_tokens=False)["input_ids"][:sampling.max_tokens]
            k = len(self.calls)
            out.append(Sample(0, list(p), ids, reply, [-(k + 1) - t / 100 for t in range(len(ids))],
                              "stop" if len(ids) < sampling.max_tokens or ids[-1] == self.tok.eos_token_id
                              else "length"))
        self.calls.append((prompts, out))
        return out


ROWS = [{"prompt": "q", "a": 12, "b": 30}, {"prompt": "q", "a": 7, "b": 5}]


def assert_recorded_exactly(sample, calls):
    """Every token of `sample` is either one the engine sampled, with its logprob and in the loss,
    for exactly the context before it (an engine call's prompt), or a masked token the chat template
    put between turns. `calls`: (prompt ids, sample) of every engine call. Returns the turns."""
    answered = {}  # context -> the engine's samples for it (a row's rollouts share their first context)
    for p, s in calls:
        answered.setdefault(tuple(p), []).append(s)
    context, ids, turns, i = list(sample.prompt_token_ids), sample.token_ids, 0, 0
    while i < len(ids):
        while i < len(ids) and sample.tool_mask[i] == 0:
            assert sample.logprobs[i] == 0.0
            context.append(ids[i])
            i += 1
        if i == len(ids):
            break
        # the engine was sent exactly the recorded context, and sampled exactly the recorded tokens
        n = next((min(len(e.token_ids), len(ids) - i) for e in answered.get(tuple(context), ())
                  if ids[i:i + len(e.token_ids)] == e.token_ids[:len(ids) - i]
                  and sample.logprobs[i:i + len(e.token_ids)] == e.logprobs[:len(ids) - i]), None)
        assert n is not None, f"tokens {i}.. of the sample are no engine call's answer to the context before them"
        assert sample.tool_mask[i:i + n] == [1] * n
        context += ids[i:i + n]
        i, turns = i + n, turns + 1
    return turns


USER_FILE = '''
import asyncio


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def wait(seconds: float) -> str:
    """Wait a while.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "waited"


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


def nodoc(a: int) -> int:
    return a


class Counter:
    """A TRL-style environment: reset, two tools, get_reward."""

    def __init__(self):
        self.total = 0

    def reset(self, start=0, **row):
        self.total = int(start)
        return f"The counter starts at {self.total}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total

    async def read(self) -> int:
        """Read the counter."""
        return self.total

    def get_reward(self) -> float:
        return float(self.total == 10)

    def _helper(self):
        return None


class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: A number.
        """
        return x
'''
