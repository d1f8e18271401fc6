"""Faults on purpose (`RLKIT_FAULT`): which tensors a broken sync drops, and at which engine."""

from __future__ import annotations

import time

import pytest

from rlkit import faults

NAMED = [("model.layers.0.mlp.down_proj.weight", 0), ("model.layers.1.mlp.down_proj.weight", 1),
         ("model.norm.weight", 2)]


def test_no_fault_changes_nothing(monkeypatch):
    monkeypatch.delenv(faults.VARIABLE, raising=False)
    assert faults.skip_tensors(NAMED, 0) is NAMED
    t0 = time.perf_counter()
    faults.hang_here("weight_sync", 0)
    assert time.perf_counter() - t0 < 0.1


def test_sync_skip_drops_the_named_tensors_at_the_named_engine(monkeypatch):
    monkeypatch.setenv(faults.VARIABLE, "sync_skip:layers.1.mlp:1")
    assert list(faults.skip_tensors(NAMED, 0)) == NAMED
    assert [n for n, _ in faults.skip_tensors(NAMED, 1)] == ["model.layers.0.mlp.down_proj.weight",
                                                            "model.norm.weight"]
    monkeypatch.setenv(faults.VARIABLE, "hang:generate:3; sync_skip:down_proj")  # every engine, two faults
    assert [n for n, _ in faults.skip_tensors(NAMED, 5)] == ["model.norm.weight"]
    t0 = time.perf_counter()
    faults.hang_here("generate", 2)  # another engine: no hang
    faults.hang_here("weight_sync", 3)  # another phase: no hang
    assert time.perf_counter() - t0 < 0.1


def test_hang_lets_the_first_calls_through(monkeypatch):
    monkeypatch.setenv(faults.VARIABLE, "hang:weight_sync:7:2")
    monkeypatch.setattr(faults.time, "sleep", lambda s: (_ for _ in ()).throw(TimeoutError(s)))
    faults.hang_here("weight_sync", 7)
    faults.hang_here("weight_sync", 7)
    with pytest.raises(TimeoutError):
        faults.hang_here("weight_sync", 7)  # the third call hangs


def test_enospc_lets_the_first_checkpoints_through_at_the_named_learner(monkeypatch):
    monkeypatch.setenv(faults.VARIABLE, "enospc:learner1:1")
    faults.full_disk_here("learner0")
    faults.full_disk_here("learner1")
    faults.full_disk_here("learner0")  # another learner: never
    with pytest.raises(OSError, match="No space left on device"):
        faults.full_disk_here("learner1")  # its second checkpoint
