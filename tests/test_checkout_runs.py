"""The README's test command passes in a checkout where the README's other commands have run: the
tests that resolve a recipe's relative paths do so in their own folders, never in the checkout's
runs/ (the suite also fails if any test writes there: `checkout_runs_untouched` in conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import recipe_run_paths
from tests.helpers import ROOT

# tests that load the shipped recipes with their relative paths, in-process
CWD_SENSITIVE = ["tests/commands/test_export.py",
                 "tests/test_tiny.py::test_tiny_model_and_task_are_built_only_when_asked_and_said"]


def test_tests_pass_beside_a_users_runs(tmp_path, tiny_model):
    """A copy of the checkout whose runs/ holds what `rlkit demo` and the tiny recipes leave (a
    model in every recipe's default folder): the cwd-sensitive tests still pass there."""
    view = tmp_path / "checkout"
    view.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git", ".venv"):
            (view / entry.name).symlink_to(entry)
    for folder in recipe_run_paths():
        for sub in ("", "final", "model"):
            target = view / folder.relative_to(ROOT) / sub
            shutil.copytree(tiny_model, target, dirs_exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CWD_SENSITIVE],
                         cwd=view, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
