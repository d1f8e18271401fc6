"""The code sandbox's throwaway uids as root (`rlkit/sandbox/uids.py`): no two runs on a host hold one
uid at once, within a driver (past 1,000 runs under way) and across drivers that start from the same
place, a driver's claims end with it, and every judged sample gives its uid back."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlkit.errors import RewardError
from rlkit.sandbox import uids
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="throwaway uids are claimed as root only")

HOLDER = """
import sys, time
from rlkit.sandbox import uids
uids._next = int(sys.argv[1])
print(uids.claim(), flush=True)
sys.stdin.readline()  # hold it until told
"""


def test_no_uid_comes_round_while_a_driver_holds_it():
    """(The pid-and-counter uids of before came round after 1,000 runs of one driver.)"""
    got = [uids.claim() for _ in range(1005)]
    try:
        assert len(set(got)) == len(got) and all(uids.BASE <= u < uids.BASE + uids.SPAN for u in got)
        assert uids.held() >= set(got)
    finally:
        for u in got:
            uids.release(u)
    assert not uids.held() & set(got)
    assert not any(os.path.exists(os.path.join(uids.FOLDER, str(u))) for u in got)


def test_two_drivers_that_start_from_one_uid_never_share_it(monkeypatch):
    """(Two drivers whose pids differed by a multiple of 100,000 shared every uid before.)"""
    start = 4242
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(start)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(holder.stdout.readline())
        assert theirs == uids.BASE + start
        monkeypatch.setattr(uids, "_next", start)
        ours = uids.claim()
        uids.release(ours)
        assert ours != theirs
    finally:
        holder.kill()  # a driver's claims end with it, however it ends
        holder.wait()
    monkeypatch.setattr(uids, "_next", start)
    again = uids.claim()
    uids.release(again)
    assert again == theirs


def test_every_judged_sample_gives_its_uid_back(monkeypatch):
    """(Other drivers on the host, such as the suite's other worker, hold uids of their own meanwhile.)"""
    from rewards.code import run_tests

    claimed, claim = [], uids.claim
    monkeypatch.setattr(uids, "claim", lambda *a, **k: claimed.append(claim(*a, **k)) or claimed[-1])
    for isolation in ("namespaces", "process"):
        verdict = run_tests("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4"],
                            timeout_s=5.0, isolation=isolation)
        assert verdict.score == 0.5
    assert len(claimed) == 4 and not uids.held() & set(claimed)  # two programs a sample, each uid given back
    assert not any(os.path.exists(os.path.join(uids.FOLDER, str(u))) for u in claimed)


def test_a_claims_folder_others_may_enter_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "uids"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    monkeypatch.setattr(uids, "FOLDER", str(folder))
    with pytest.raises(RewardError) as e:
        uids.claim()
    assert str(e.value).startswith(f"{folder} is not a folder only root may enter") and "\n" not in str(e.value)


DIES_HOLDING = """
import os, subprocess, sys
from rlkit.sandbox import uids
uids._next = int(sys.argv[1])
uid = uids.claim()
left = subprocess.Popen(["sleep", "60"], user=uid, group=uid, start_new_session=True, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
print(uid, left.pid, flush=True)
os._exit(0)  # dies holding the uid, never released: its sample's process runs on
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_uid_a_dead_driver_held_is_swept_before_it_is_given_again(monkeypatch):
    from rlkit.sandbox.walls import next_uid

    start = 5151
    out = subprocess.run([sys.executable, "-c", DIES_HOLDING, str(start)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    uid, pid = map(int, out.stdout.split())
    assert os.path.exists(os.path.join(uids.FOLDER, str(uid)))  # claimed and never given back
    monkeypatch.setattr(uids, "_next", start)
    again = next_uid()
    try:
        assert again == uid
        for _ in range(50):  # the sweep's SIGKILL (the process is init's child now: reaped by it)
            if not _running(pid):
                break
            time.sleep(0.1)
        assert not _running(pid)
    finally:
        uids.release(again)
