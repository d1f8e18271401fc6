"""Run model-written Python against test cases; reward = fraction passed, judged outside the sandbox.

Test cases (the ``test_cases`` column, or open-r1's ``verification_info`` (same shape), one list
per sample, or its JSON string; an open-r1 entry whose ``language`` is not Python scores None, not
applicable):
* a single ``assert`` statement, e.g. ``"assert add(2, 3) == 5"``;
* ``{"input": str, "output": str}``: the solution runs as ``__main__`` with that stdin and its
  stdout must equal ``output`` (trailing whitespace per line ignored).

The candidate's sandbox gets the code and the arguments of its calls only; the tests run in a
sandbox of their own that never runs the candidate's code, and compute every expected value and
comparison there on the plain data the candidate sends back (`rlkit.sandbox.judge`). The sandbox
(`rlkit.sandbox.programs`) is bubblewrap's namespaces, root or not (or a SandboxFusion service with
``isolation: remote``); a host without them is refused before launch unless the recipe sets
``isolation: process``. Every case of
``tests/rewards/test_sandbox_attacks.py`` is contained, as root and as an ordinary user.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlkit.reward.contract import Failed, batch_seconds, completion_text, needs_one_of, reward_range
from rlkit.sandbox.judge import Verdict, cases_of, check_tests, judge
from rlkit.sandbox.programs import Limits, Sandbox

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: Any) -> str:
    """The last fenced code block (```python, ```py or bare ```); "" when there is none."""
    blocks = _FENCE.findall(completion_text(completion))
    return blocks[-1] if blocks else ""


def run_tests(code: str, tests: list, *, timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 4,
              scratch_mb: int = 64, output_kb: int = 1024, isolation: str = "namespaces",
              sandbox_url: str | None = None, audit: bool = True) -> Verdict:
    """Judge ``code`` against ``tests`` (see the module doc and `rlkit.sandbox.programs.Limits`).

    audit: the in-process audit hook as an extra layer (tests turn it off to show that the
    kernel's walls hold on their own).
    """
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, scratch_mb=scratch_mb,
                    output_kb=output_kb)
    return judge(code, tests, Sandbox(isolation, limits, sandbox_url), audit)


def _preflight(args: dict[str, Any], key: str) -> None:
    """Before launch: the sandbox the recipe asks for can run here (else one line)."""
    Sandbox(args.get("isolation", "namespaces"), url=args.get("sandbox_url")).check(
        key=f"{key}.args.isolation", url_key=f"{key}.args.sandbox_url")


SANDBOX_START_S = 2.0  # a sandbox's start and its judge, at most (measured: 11 ms a sample, bench_code_reward.py)


def _batch_seconds(n: int, args: dict[str, Any]) -> float:
    """What a batch of `n` samples may take: each sample runs at most two sandboxes (its test's
    own values, then the candidate), each killed at `timeout_s` (plus its start), `workers` at a
    time."""
    per_sample = 2 * (float(args.get("timeout_s", 5.0)) + SANDBOX_START_S)
    return math.ceil(n / _workers(args.get("workers"))) * per_sample + SANDBOX_START_S


def _workers(workers: int | None) -> int:
    """The samples judged at once: `workers`, default the CPU count (the pool and the batch's time)."""
    return workers or os.cpu_count() or 1


@reward_range(0.0, 1.0)
@needs_one_of("test_cases", "verification_info")
@batch_seconds(_batch_seconds)
def code_reward(completions: list, test_cases: list | None = None, verification_info: list | None = None,
                timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 4, scratch_mb: int = 64,
                output_kb: int = 1024, isolation: str = "namespaces", sandbox_url: str | None = None,
                on_crash: float | None = 0.0, workers: int | None = None, **kwargs: Any) -> list[float | None]:
    """Fraction of the test cases (``test_cases``, else ``verification_info``) the last fenced
    code block of each completion passes.

    0.0 without a code block; None for samples without test cases. ``on_crash``: the score of a
    sample whose sandbox was killed before every test reported (wall clock, output flood), 0.0 or
    None; such a sample is counted in ``reward/code_reward/errors`` (a `Failed` score), and a batch
    is given the time its samples' limits add up to (`batch_seconds`), so slow samples cost
    themselves, never the step. ``isolation``: "namespaces" (bubblewrap, the default), "remote" (a SandboxFusion
    ``/run_code`` service at ``sandbox_url``; the judge stays here) or "process" (weaker, see
    `rlkit.sandbox.programs`). Samples run in parallel (``workers``, default: CPU count), each in its own sandbox.
    """
    column = test_cases if test_cases is not None else verification_info
    if column is None:
        raise ValueError("code_reward needs a 'test_cases' or 'verification_info' column")
    tests = [cases_of(t) for t in column]
    codes = [extract_code(c) for c in completions]
    box = Sandbox(isolation, Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                                    scratch_mb=scratch_mb, output_kb=output_kb), sandbox_url)

    def one(i: int) -> float | None:
        if tests[i] is None:
            return None
        if not codes[i].strip():
            return 0.0
        v = judge(codes[i], tests[i], box)
        if (v.timed_out or v.flooded) and v.passed < v.total:
            why = f"ran past its {timeout_s:g} s" if v.timed_out else f"wrote past its {output_kb} KiB of output"
            return None if on_crash is None else Failed(on_crash, f"was killed: its code {why}")
        return v.score

    with ThreadPoolExecutor(max_workers=_workers(workers)) as pool:
        return list(pool.map(one, range(len(completions))))


def _check_row(row: dict[str, Any]) -> None:
    """Before launch: the row's test cases are ones the judge runs apart from the candidate's code."""
    column = row.get("test_cases") if row.get("test_cases") is not None else row.get("verification_info")
    check_tests(cases_of(column) or [])


code_reward.rlkit_preflight = _preflight
code_reward.rlkit_check_row = _check_row
code_reward.rlkit_runs_code = "sandbox"  # `rlkit reward test` plays every sandbox probe, the bombs too
