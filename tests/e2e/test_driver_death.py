"""Nothing of a GRPO run outlives its driver, however the driver dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import left_running, marked_env
from tests.helpers import GRPO_RECIPE, grpo_overrides, logged_steps

pytestmark = pytest.mark.slow


def test_a_sigkilled_driver_leaves_no_process_of_the_run(sft_model, task_data, tmp_path):
    """SIGKILL of the driver alone mid-run (an out-of-memory killer, a scheduler's hard stop): its
    watcher ends Ray's services, the actors and vLLM's processes. Before it, Ray's dashboard and
    runtime-env agents (which do not inherit the driver's environment: found here as the driver's
    descendants) stayed up for a minute or more."""
    import psutil

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlkit.cli", "grpo", str(GRPO_RECIPE),
           *grpo_overrides(sft_model, task_data, out, "grpo.steps=40", "eval.every=0", "checkpoint.every=0")]
    proc = subprocess.Popen(cmd, env=marked_env(tmp_path.name), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while logged_steps(out) < 1:
        assert proc.poll() is None and time.time() < deadline, "run ended or stalled before the kill"
        time.sleep(0.2)
    started = psutil.Process(proc.pid).children(recursive=True)
    names = {p.name() for p in started}
    assert {"raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(started, timeout=20)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not left_running(tmp_path.name, wait_s=5)
