"""What the benchmark scripts share: spread statistics over timed steps, the machine line,
running a phase in a fresh process, and running an `rlkit` command."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def prepare() -> None:
    """A benchmark's process: one OpenMP thread unless set, quiet tokenizers, the checkout importable."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def rlkit(*args: str, cwd: Path) -> str:
    """`rlkit ARGS` in `cwd` with this Python (one OpenMP thread unless set); its stdout. A failure
    ends the script with the command's last stderr."""
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if out.returncode:
        sys.exit(f"rlkit {' '.join(args[:2])} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def quiet() -> None:
    """transformers', datasets' and rlkit's logging and progress bars off: the table is the output."""
    import logging

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    logging.getLogger("rlkit").setLevel(logging.ERROR)


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


def run_spawned_together(*calls: tuple[Any, ...]) -> list[Any]:
    """Each `(fn, *args)` in its own fresh spawned process, all at once; their results in order."""
    with ProcessPoolExecutor(len(calls), mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *args) for fn, *args in calls]
        return [f.result() for f in futures]


def meet(barrier: str | None, parties: int = 2, timeout_s: float = 600.0) -> None:
    """Wait until `parties` processes have reached the folder `barrier` (None: return at once), so
    that processes set up at different speeds start their timed work together."""
    import os
    import time

    if barrier is None:
        return
    Path(barrier).mkdir(parents=True, exist_ok=True)
    (Path(barrier) / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(Path(barrier).iterdir())) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{barrier}: the other process did not arrive within {timeout_s:.0f} s")
        time.sleep(0.01)


_OVERTIME: dict[str, float] = {}  # barrier -> when this process finished its own steps


def keep_going(barrier: str | None, step: int, steps: int, parties: int = 2, timeout_s: float = 600.0) -> bool:
    """Whether a process timed beside another (`meet` at `barrier`) takes step `step`: its own
    `steps`, then more until every party has done its own (so that each runs its steps while the
    other still runs: only steps inside the time both ran count)."""
    import os
    import time

    if step < steps:
        return True
    if barrier is None:
        return False
    done = Path(barrier) / "done"
    done.mkdir(exist_ok=True)
    (done / str(os.getpid())).touch()
    started = _OVERTIME.setdefault(barrier, time.monotonic())
    return len(list(done.iterdir())) < parties and time.monotonic() - started < timeout_s


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a two-rank row's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    """The CPU's vector units: AVX-512 (MKL's fp32 kernels run about twice as wide) and native bf16
    matmuls (AVX512-BF16); results differ between machines that have them and machines that don't."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    has = lambda flag: "yes" if flag in flags else "no"  # noqa: E731
    return f"avx512f {has('avx512f')}, avx512_bf16 {has('avx512_bf16')}"


def params(model_dir: Path) -> str:
    from rlkit.tiny import param_count

    return f"{param_count(model_dir) / 1e6:.1f}M params"


def real_model(spec: str) -> tuple[Path, dict[str, Path]]:
    """A bench's `--model`: an HF folder, a `.gguf` file (imported once into rlkit's cache) or
    a real model's name (`rlkit.gsm8k.real_model`: smollm2, gemma3-270m); with the GSM8K task's
    files (`rlkit.gsm8k`, generated into runs/gsm8k/data as scripts/real_task.py does, reused)."""
    from rlkit.gsm8k import real_model, write_task
    from rlkit.model.gguf import import_gguf, is_gguf

    path = real_model(spec)
    folder = import_gguf(path) if is_gguf(path) else path
    if not (folder / "config.json").is_file():
        sys.exit(f"--model {spec}: no config.json in {folder}; name an HF model folder, a .gguf file, smollm2 or "
                 "gemma3-270m")
    root = Path(__file__).resolve().parents[1]
    return folder, write_task(root / "runs" / "gsm8k" / "data")


def model_line(model_dir: Path, name: str) -> str:
    """The model in a bench's header: its name and parameter count."""
    return f"model {name} ({params(model_dir)})"
