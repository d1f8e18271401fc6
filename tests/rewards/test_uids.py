"""The code sandbox's throwaway uids as root (`rlkit/reward/uids.py`): no two runs on a host hold one
uid at once, within a driver (past 1,000 runs under way) and across drivers that start from the same
place, a driver's claims end with it, and every judged sample gives its uid back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlkit.errors import RewardError
from rlkit.reward import uids
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="throwaway uids are claimed as root only")

HOLDER = """
import sys, time
from rlkit.reward import uids
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


def test_every_judged_sample_gives_its_uid_back():
    from rewards.code import run_tests

    before = set(os.listdir(uids.FOLDER)) if os.path.isdir(uids.FOLDER) else set()
    for isolation in ("namespaces", "process"):
        verdict = run_tests("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4"],
                            timeout_s=5.0, isolation=isolation)
        assert verdict.score == 0.5
    assert not uids.held() and set(os.listdir(uids.FOLDER)) <= before


def test_a_claims_folder_others_may_enter_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "uids"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    monkeypatch.setattr(uids, "FOLDER", str(folder))
    with pytest.raises(RewardError) as e:
        uids.claim()
    assert str(e.value).startswith(f"{folder} is not a folder only root may enter") and "\n" not in str(e.value)
