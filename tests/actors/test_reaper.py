"""The run's folder on a host (`rlkit.actors.reaper.run_folder`: the engines' LoRA adapter versions)
goes with the run, however the driver ends (the processes themselves: tests/e2e/test_driver_death.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

DRIVER = """
import os, signal, sys
from rlkit.actors import reaper
stop = reaper.watch()
folder = reaper.run_folder("engine0")
(folder / "adapter").write_text("x")
print(folder, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
stop()
"""


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_the_runs_folder_is_removed_when_its_driver_is_done_or_killed(tmp_path, how):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("RLKIT_RUN_TOKEN", None)
    out = subprocess.run([sys.executable, "-c", DRIVER, how], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    folder = Path(out.stdout.strip())
    assert folder.parent.parent == tmp_path and folder.parent.name.startswith("rlkit-run-"), out
    deadline = time.monotonic() + 15
    while folder.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.parent.exists()
