"""Derived seeds: stable across processes, distinct per use, within the asked range."""

import subprocess
import sys

import pytest

from rlkit.seeding import derive_seed


def test_derived_seeds_are_distinct_per_use_and_bounded():
    seeds = {derive_seed(0, "generate", step, attempt) for step in range(50) for attempt in range(4)}
    seeds |= {derive_seed(0, "plan", step) for step in range(50)} | {derive_seed(1, "generate", 0, 0)}
    assert len(seeds) == 50 * 4 + 50 + 1  # `seed + step` would collide across uses
    assert all(0 <= s < 2**62 for s in seeds)
    assert all(0 <= derive_seed(7, "engine", i, bits=31) < 2**31 for i in range(100))
    with pytest.raises(ValueError, match="bits"):
        derive_seed(0, bits=0)


def test_derived_seeds_do_not_depend_on_the_process():
    code = ("from rlkit.seeding import derive_seed\n"
            "print(derive_seed(42, 'eval'), derive_seed(42, 'engine', 1, bits=31))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert runs == {f"{derive_seed(42, 'eval')} {derive_seed(42, 'engine', 1, bits=31)}\n"}
