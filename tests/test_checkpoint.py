"""Atomic checkpoints: keep-last-K with a protected best, half-written ones never resumed."""

from rlkit.checkpoint import CheckpointManager


def test_prune_keeps_last_k_and_protected_best(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        m.commit(m.staging_dir(step), step, {"x": step}, protect={10})
    assert m.steps() == [10, 30, 40]
    (tmp_path / ".tmp-step-50").mkdir()  # a half-written checkpoint (killed run) is not resumed
    assert m.latest().name == "step-40" and m.load_state(m.latest())["x"] == 40
