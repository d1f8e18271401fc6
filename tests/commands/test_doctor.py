"""`rlkit doctor`: one line per check, exit 1 when one fails (the whole command, with its real vLLM
engine and Ray, is a slow test; the verdicts of single checks are fast ones)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from rlkit.commands import doctor
from tests.helpers import ROOT


@pytest.mark.slow
def test_doctor_passes_on_this_host():
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "doctor"], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert [line.split(":")[0].split(maxsplit=1)[1] for line in lines] == [
        "device", "versions", "communication", "vLLM", "Ray", "shared memory", "disk", "code sandbox", "sandbox memory"]
    assert all(line.split()[0] in ("ok", "warn") for line in lines), lines
    assert lines[3].startswith("ok    vLLM: a tiny engine started and generated in ")


def test_versions_say_what_differs_from_the_lock_and_what_is_missing(tmp_path, monkeypatch):
    from importlib.metadata import version

    lock = tmp_path / "lock.txt"
    lock.write_text(f"# a lock\ntorch=={version('torch')}\nray==0.0.1\n")
    monkeypatch.setattr(doctor, "LOCK", lock)
    monkeypatch.setattr(doctor, "CHECKED", ("torch", "ray"))
    assert doctor.versions() == ("warn", "versions", f"differ from requirements/lock-cpu.txt: ray {version('ray')} "
                                                     "(tested 0.0.1)")
    monkeypatch.setattr(doctor, "CHECKED", ("torch", "no-such-package"))
    assert doctor.versions() == ("FAIL", "versions", "not installed: no-such-package (bash scripts/setup.sh installs "
                                                     "them)")


def test_a_failed_check_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(doctor, "ray_reachable", lambda address: ("FAIL", "Ray", f"cannot reach {address}"))
    monkeypatch.setattr(doctor, "comm_backend", lambda: 1 / 0)  # a check that breaks is a failed check too
    args = argparse.Namespace(address="10.0.0.9:6379", output_dir=str(tmp_path / "runs"), skip_engine=True)
    assert doctor.run(args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "FAIL  Ray: cannot reach 10.0.0.9:6379" in lines
    assert "FAIL  communication: ZeroDivisionError: division by zero" in lines
    disk = next(line for line in lines if "disk:" in line)
    assert f"free under {tmp_path / 'runs'}" in disk  # a folder not made yet: its nearest parent's disk


def test_the_code_sandbox_check_says_why_code_rewards_would_refuse(monkeypatch):
    from rlkit.sandbox import walls

    monkeypatch.setattr(walls, "namespaces_problem", lambda python=None: "bubblewrap is not installed")
    status, what, detail = doctor.code_sandbox()
    assert (status, what) == ("warn", "code sandbox") and detail.startswith("bubblewrap is not installed; code rewards")


def test_the_sandbox_memory_check_says_whether_a_sample_gets_a_cgroup(monkeypatch):
    from rlkit.sandbox import cgroup

    monkeypatch.setattr(cgroup, "delegated", lambda: None)
    status, what, detail = doctor.sandbox_memory()
    assert (status, what) == ("warn", "sandbox memory") and "bounded per process (memory_mb each" in detail
    monkeypatch.setattr(cgroup, "delegated", lambda: ("/sys/fs/cgroup/x", 2))
    assert doctor.sandbox_memory() == ("ok", "sandbox memory", "each sandboxed sample gets a memory cgroup (v2, under "
                                       "/sys/fs/cgroup/x): its processes and scratch folders hold memory_mb + "
                                       "scratch_mb in all")
