"""The run directory under faults: an output_dir that is a file, a full disk during a checkpoint
or the final save (the earlier checkpoint intact, one line with the path and the bytes), stop
signals, and a fault's one line naming the checkpoint to resume from (detail in rlkit.log)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import pytest

from rlkit.errors import FaultError, Stopped, UserError
from rlkit.run.checkpoint import verify
from rlkit.run.rundir import LOG_FILE
from rlkit.run.stops import EXIT_STOPPED
from tests.helpers import FakeLearners, grpo_run_dir


def test_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("mine")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        with pytest.raises(UserError, match=r"^output_dir: .*taken.* is a file, not a directory; choose another"):
            grpo_run_dir(out)
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (needs root, as on CI's machines); skipped where it cannot be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_in_a_checkpoint_keeps_the_previous_one(small_disk):
    """torch.save on a full disk raises a RuntimeError with no errno: still named a full disk."""
    run = grpo_run_dir(small_disk / "run")
    run.checkpoint(1, FakeLearners(1 << 20), {"step": 1})
    with pytest.raises(FaultError) as e:
        run.checkpoint(2, FakeLearners(3 << 20), {"step": 2})
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step 2: the disk is full under {small_disk / 'run' / 'checkpoints'} (it needs "
                          "about 1.0 MiB (")
    assert " free): free some space" in msg and "\n" not in msg
    assert run.ckpts.steps() == [1] and verify(run.ckpts.root / "step-1") is None
    assert not list(run.ckpts.root.glob(".tmp-*"))  # the half-written one is gone, its space given back
    with pytest.raises(FaultError, match=r"^the final save: the disk is full under .*run \(it needs about 2\.0 MiB"):
        run.save_final(FakeLearners(3 << 20), "tok", needed=2 << 20)
    assert not run.final.exists() and not (small_disk / "run" / ".tmp-final").exists()


def test_enospc_from_a_learner_is_a_full_disk_and_other_errors_stay_bugs(tmp_path):
    run = grpo_run_dir(tmp_path / "run")
    run.checkpoint(1, FakeLearners(1000), {"step": 1})
    with pytest.raises(FaultError, match=r"^checkpoint step 2: the disk is full under .* \(it needs about \d+\.\d KiB "
                                         r"\(\d+ bytes\), .* free\): free some space$"):
        run.checkpoint(2, FakeLearners(1000, OSError(errno.ENOSPC, "No space left on device")), {"step": 2})
    with pytest.raises(ValueError, match="a bug"):
        run.checkpoint(2, FakeLearners(1000, ValueError("a bug")), {"step": 2})
    assert run.ckpts.steps() == [1] and not list(run.ckpts.root.glob(".tmp-*"))
    run.save_final(FakeLearners(1000), "tok")
    assert (run.final / "model.pt").exists()


def test_a_fault_names_the_checkpoint_to_resume_from_and_logs_the_detail(tmp_path):
    run = grpo_run_dir(tmp_path / "run")
    with pytest.raises(FaultError) as e, run.session():
        raise FaultError("learner 1 died during the training step (pid 7)") from RuntimeError("ray's long story")
    assert str(e.value) == (f"learner 1 died during the training step (pid 7); no checkpoint was written yet, so a "
                            f"rerun starts over (details: {tmp_path / 'run' / LOG_FILE})")
    run.checkpoint(4, FakeLearners(100), {"step": 4})
    with pytest.raises(FaultError, match=r"; the newest checkpoint, step-4, is intact: rerun the same command to "
                                         r"resume from it \(details: "), run.session():
        raise FaultError("engine 0 died")
    assert "ray's long story" in (tmp_path / "run" / LOG_FILE).read_text()


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_a_second_at_once(tmp_path):
    run = grpo_run_dir(tmp_path / "run", "checkpoint.every=4")
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with run.stops.caught():
        assert not run.checkpoint_due(1, 4) and run.checkpoint_due(4, 4)
        run.stops.stop_if_signalled(1)  # no signal: goes on
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stops.signal == signal.SIGTERM and run.checkpoint_due(1, 4)
        with pytest.raises(Stopped, match=r"^stopped by SIGTERM after step 1; checkpoint step-1 is written") as e:
            run.stops.stop_if_signalled(1)
        assert e.value.exit_code == EXIT_STOPPED
        with pytest.raises(Stopped, match="second SIGINT") as e:
            os.kill(os.getpid(), signal.SIGINT)
        assert e.value.exit_code == 128 + signal.SIGINT
    # the handlers are put back (SIG_IGN for SIGINT where the suite runs as a background job)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_one_reader_gives_back_what_a_checkpoint_holds_for_the_driver(tmp_path):
    """A resumed run gets its step, the sampler's state, the driver's state and its payload (the
    generations in flight) through one reader; a fresh start gets step 0 and nothing else."""
    import torch

    from rlkit.run.checkpoint import Resumed, read_resume

    assert read_resume(None) == Resumed()
    run = grpo_run_dir(tmp_path / "run")
    run.checkpoint(3, FakeLearners(100), {"pos": 7}, driver={"best": 0.5},
                   payload={"generations": [{"ids": torch.arange(4)}]})
    run.checkpoint(4, FakeLearners(100), {"pos": 9})
    third, fourth = read_resume(run.ckpts.root / "step-3"), read_resume(run.ckpts.latest())
    assert (third.step, third.sampler, third.driver) == (3, {"pos": 7}, {"best": 0.5})
    assert torch.equal(third.payload["generations"][0]["ids"], torch.arange(4))
    assert (fourth.step, fourth.sampler, fourth.driver, fourth.payload) == (4, {"pos": 9}, {}, None)
