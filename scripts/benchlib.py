"""What the benchmark scripts share: spread statistics over timed steps, the machine line, and
running a phase in a fresh process."""

from __future__ import annotations

import multiprocessing as mp
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def spread(xs: list[float]) -> dict[str, float]:
    """n, median, min and max of timed values (NaN for none)."""
    if not xs:
        return {"n": 0, "median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


SPREAD_HEADER = f"{'median':>9}{'min':>8}{'max':>8}{'n':>4}"


def spread_cells(s: dict[str, float]) -> str:
    """The columns under `SPREAD_HEADER`."""
    return f"{s['median']:>9.3f}{s['min']:>8.3f}{s['max']:>8.3f}{s['n']:>4d}"


def run_spawned(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh spawned process (its own Ray / vLLM / threads); returns its result."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def machine() -> str:
    """Whether this CPU has native bf16 matmuls (results differ between machines that do and don't)."""
    try:
        bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        bf16 = False
    return f"avx512_bf16 {'yes' if bf16 else 'no'}"


def params(model_dir: Path) -> str:
    from rlkit.tiny import param_count

    return f"{param_count(model_dir) / 1e6:.1f}M params"
