"""Atomic, verified checkpoints: keep-last-K with a protected best, half-written ones never
resumed, damaged ones found by their manifest (auto resume falls back, an explicit one fails)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from rlkit.errors import UserError
from rlkit.run.checkpoint import MANIFEST, STATE_FILE, CheckpointManager, file_hash, resolve_resume, verify


def test_prune_keeps_last_k_and_protected_best(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        m.commit(m.staging_dir(step), step, {"x": step}, protect={10})
    assert m.steps() == [10, 30, 40]
    (tmp_path / ".tmp-step-50").mkdir()  # a half-written checkpoint (killed run) is not resumed
    assert m.latest().name == "step-40" and m.load_state(m.latest())["x"] == 40


def _three(tmp_path):
    """Checkpoints 1, 2, 3 shaped like a learner's: a rank file, an optimizer state, a subfolder."""
    m = CheckpointManager(tmp_path / "ckpts", keep_last=3)
    for step in (1, 2, 3):
        staging = m.staging_dir(step)
        (staging / "engine").mkdir()
        (staging / "engine" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(3000 + step))
        (staging / "engine" / "optim_states.pt").write_bytes(os.urandom(5000))
        (staging / "rng_rank1.pt").write_bytes(b"rng")
        m.commit(staging, step, {"sampler": {"step": step}})
    return m


def _truncate(path, keep=100):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage, problem", [
    (lambda c: (c / MANIFEST).write_text('{"files": {"engine/optim'), f"its {MANIFEST} is damaged"),
    (lambda c: (c / MANIFEST).unlink(), f"it has no {MANIFEST}"),
    (lambda c: (c / "rng_rank1.pt").unlink(), "rng_rank1.pt is missing"),
    (lambda c: _truncate(c / "engine" / "optim_states.pt"),
     "engine/optim_states.pt has 100 bytes, the manifest says 5000"),
    (lambda c: _truncate(c / STATE_FILE, 10), f"{STATE_FILE} has 10 bytes, the manifest says"),
    (lambda c: (c / "engine" / "optim_states.pt").write_bytes(b"x" * 5000),
     "engine/optim_states.pt does not match its hash in the manifest"),
], ids=["damaged-manifest", "no-manifest", "missing-rank-file", "truncated-optimizer", "truncated-state",
        "same-size-other-bytes"])
def test_damaged_newest_checkpoint_is_skipped_by_auto_and_refused_by_path(tmp_path, caplog, damage, problem):
    m = _three(tmp_path)
    assert all(verify(m.root / f"step-{s}") is None for s in (1, 2, 3))
    damage(m.root / "step-3")
    assert problem in verify(m.root / "step-3")
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        assert resolve_resume(m, "auto") == m.root / "step-2"
    assert f"step-3 is damaged ({problem}" in caplog.text and "resuming from" in caplog.text
    with pytest.raises(UserError, match=rf"^checkpoint.resume: .*step-3 is damaged: {problem}.*auto picks the newest"):
        resolve_resume(m, str(m.root / "step-3"))
    assert resolve_resume(m, str(m.root / "step-2")) == m.root / "step-2"


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    m = _three(tmp_path)
    for s in (1, 2, 3):
        _truncate(m.root / f"step-{s}" / "engine" / "optim_states.pt")
    with pytest.raises(UserError, match=r"no intact checkpoint in .*step-3: engine/optim_states.pt has 100 bytes"):
        resolve_resume(m, "auto")
    assert resolve_resume(m, "never") is None and resolve_resume(CheckpointManager(tmp_path / "new", 1), "auto") is None


def test_large_files_hash_sampled_blocks_including_both_ends(tmp_path):
    """Past 64 MiB only 64 blocks are read; damage at either end (a bad copy's usual place) shows."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(100 << 20)
    size = big.stat().st_size
    before = file_hash(big, size)
    for offset in (0, size - 1):
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        assert file_hash(big, size) != before
        before = file_hash(big, size)


def test_manifest_lists_every_file_with_size(tmp_path):
    m = _three(tmp_path)
    files = json.loads((m.root / "step-1" / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted([STATE_FILE, "engine/mp_rank_00_model_states.pt", "engine/optim_states.pt",
                                    "rng_rank1.pt"])
    assert files["engine/mp_rank_00_model_states.pt"]["size"] == 3001
