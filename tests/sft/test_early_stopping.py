"""Early stopping and best-checkpoint bookkeeping (hand-checked sequences)."""

from rlkit import stages
from rlkit.sft.run import EarlyStopping
from tests.helpers import ROOT


def _cfg(*extra):
    return stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", list(extra))


def test_patience_counts_evals_without_improvement():
    cfg = _cfg("eval.patience=2", "eval.min_delta=0.1")
    state = EarlyStopping()
    # 3.0 best; 2.95 is not better by min_delta 0.1; 2.5 is; then 2.45, 2.49: two bad evals -> stop.
    assert [state.update(x, s, cfg.eval) for s, x in [(10, 3.0), (20, 2.95), (30, 2.5), (40, 2.45), (50, 2.49)]] \
        == [False, False, False, False, True]
    assert state.best_step == 30 and state.best_eval == 2.5
    assert EarlyStopping(**state.state()) == state  # what a checkpoint keeps restores it


def test_no_patience_never_stops():
    cfg = _cfg("eval.patience=null")
    state = EarlyStopping()
    assert not any(state.update(x, s, cfg.eval) for s, x in enumerate([1.0, 2.0, 3.0, 4.0]))
