"""Early stopping and best-checkpoint bookkeeping (hand-checked sequences)."""

from rlkit import config
from rlkit.checkpoint import CheckpointManager
from rlkit.sft.run import _early_stopping
from tests.sft.conftest import ROOT


def _cfg(*extra):
    return config.load("sft", ROOT / "recipes" / "tiny-sft.yaml", list(extra))


def test_patience_counts_evals_without_improvement():
    cfg = _cfg("eval.patience=2", "eval.min_delta=0.1")
    state = {"best_eval": None, "best_step": None, "bad_evals": 0}
    # 3.0 best; 2.95 is not better by min_delta 0.1; 2.5 is; then 2.45, 2.49: two bad evals -> stop.
    assert [_early_stopping(state, x, s, cfg) for s, x in [(10, 3.0), (20, 2.95), (30, 2.5), (40, 2.45), (50, 2.49)]] \
        == [False, False, False, False, True]
    assert state["best_step"] == 30 and state["best_eval"] == 2.5


def test_no_patience_never_stops():
    cfg = _cfg("eval.patience=null")
    state = {"best_eval": None, "best_step": None, "bad_evals": 0}
    assert not any(_early_stopping(state, x, s, cfg) for s, x in enumerate([1.0, 2.0, 3.0, 4.0]))


def test_prune_keeps_last_k_and_protected_best(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        m.commit(m.staging_dir(step), step, {"x": step}, protect={10})
    assert m.steps() == [10, 30, 40]
    (tmp_path / ".tmp-step-50").mkdir()  # a half-written checkpoint (killed run) is not resumed
    assert m.latest().name == "step-40" and m.load_state(m.latest())["x"] == 40
