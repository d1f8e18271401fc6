"""Scoring: weighted sums, None, failures naming the sample, on_error defaults, timeouts, concurrency."""

import time

import pytest

from rlkit.reward import RewardError, RewardScorer
from tests.reward.conftest import spec


def test_trl_style_reward_scores_with_dataset_column(mod):
    s = RewardScorer([spec(mod, "exact")], columns={"answer"})
    r = s.score(["1+1=", "2+2="], ["2", "5"], None, {"answer": ["2", "4"]})
    assert r.total == [1.0, 0.0]
    assert r.per_fn == {"exact": [1.0, 0.0]}
    assert r.errors == {}


def test_weighted_sum_skips_none_and_args_bind(mod):
    s = RewardScorer([spec(mod, "length", weight=0.5, args={"scale": 2.0}), spec(mod, "maybe", weight=3.0)])
    r = s.score(["p", "p"], ["abcd", ""], None, {})
    # sample 0: 0.5 * (2*4) + 3 * 1 = 7 ; sample 1: 0.5 * 0 + (maybe -> None) = 0
    assert r.total == [7.0, 0.0]
    assert r.per_fn["maybe"] == [1.0, None]
    m = r.metrics()
    assert m["reward/maybe/none"] == 1.0 and m["reward/maybe/mean"] == 1.0
    assert m["reward/length/mean"] == 4.0 and m["reward/length/std"] == 4.0  # population std of [8, 0]
    assert m["reward/mean"] == 3.5


def test_all_none_is_an_error_unless_default(mod):
    with pytest.raises(RewardError, match=r"every reward returned None for sample 0"):
        RewardScorer([spec(mod, "maybe")]).score(["p"], [""], None, {})
    assert RewardScorer([spec(mod, "maybe")], default=-1.0).score(["p"], [""], None, {}).total == [-1.0]


def test_async_class_and_chat_completions(mod):
    s = RewardScorer([spec(mod, "async_len"), spec(mod, "Scaled", args={"factor": 10.0}, weight=0.1)])
    assert s.score(["p"], ["abc"], None, {}).per_fn == {"async_len": [3.0], "Scaled": [30.0]}
    chat = RewardScorer([spec(mod, "chat")]).score([[{"role": "user", "content": "hi"}]],
                                                   [[{"role": "assistant", "content": "hello"}]], None, {})
    assert chat.total == [5.0]


def test_duplicate_names_rejected(mod):
    with pytest.raises(RewardError, match=r"rewards\[1\]\.name: 'length' is also the name of rewards\[0\]"):
        RewardScorer([spec(mod, "length"), spec(mod, "length", args={"scale": 2})])
    RewardScorer([spec(mod, "length"), spec(mod, "length", args={"scale": 2}, name="length2")])


def test_fail_fast_names_function_and_offending_sample(mod):
    s = RewardScorer([spec(mod, "boom", fail_fast=True)])
    with pytest.raises(RewardError) as e:
        s.score(["q0", "q1", "what is 1+2?"], ["abcd", "abcde", "xyz"], None, {})
    msg = str(e.value)
    assert "rewards[0] 'boom' raised ZeroDivisionError" in msg
    assert "sample 2" in msg and "'what is 1+2?'" in msg and "'xyz'" in msg
    assert "fail_fast" in msg and "\n" not in msg


def test_a_sample_that_raises_costs_that_sample_not_the_step(mod, caplog):
    """Without fail_fast, the failing sample scores the range's low end (else 0), counted, said once;
    a function that fails for every sample of a batch still stops the run, naming it."""
    s = RewardScorer([spec(mod, "boom"), spec(mod, "length")])
    r = s.score(["q"] * 3, ["abcd", "xyz", "abcde"], None, {})
    assert r.per_fn["boom"] == [1.0, 0.0, 0.5] and r.total == [5.0, 3.0, 5.5]
    assert r.metrics()["reward/boom/errors"] == 1.0
    s.score(["q"] * 2, ["xyz", "abcd"], None, {})
    said = [rec.getMessage() for rec in caplog.records if "'boom' raised" in rec.getMessage()]
    assert len(said) == 1 and "sample 1" in said[0] and "scores 0.0" in said[0]
    ranged = RewardScorer([spec(mod, "boom", range=[-1, 1])]).score(["q"] * 2, ["abcd", "xyz"], None, {})
    assert ranged.per_fn["boom"] == [1.0, -1.0]
    with pytest.raises(RewardError, match=r"'always_boom' raised RuntimeError: broken on sample 0 .* "
                                          r"\(and on every other sample of the batch of 2\)"):
        RewardScorer([spec(mod, "always_boom")]).score(["a", "b"], ["x", "y"], None, {})


def test_values_outside_the_declared_range_stop_the_run_or_are_clipped(mod):
    with pytest.raises(RewardError, match=r"^rewards\[0\] 'declared' returned 3 at index 1 \(prompt='q1', "
                                          r"completion='abc'\), outside its range \[0, 1\]; .*`clip: true`"):
        RewardScorer([spec(mod, "declared")]).score(["q0", "q1"], ["a", "abc"], None, {})
    r = RewardScorer([spec(mod, "declared", clip=True)]).score(["q0", "q1", "q2"], ["a", "abc", "ab"], None, {})
    assert r.per_fn["declared"] == [1.0, 1.0, 1.0] and r.metrics()["reward/declared/clipped"] == 2.0
    # a recipe's range overrides the declaration, and gives one to a function that has none
    assert RewardScorer([spec(mod, "declared", range=[0, 10])]).score(["q"], ["abc"], None, {}).total == [3.0]
    with pytest.raises(RewardError, match=r"'length' returned 4 at index 0 .*outside its range \[-, 2\]"):
        RewardScorer([spec(mod, "length", range=[None, 2])]).score(["q"], ["abcd"], None, {})


@pytest.mark.parametrize("kw, message", [
    ({"range": [1, 0]}, r"range: low 1 is above high 0"),
    ({"range": [0]}, r"range: expected \[low, high\]"),
    ({"clip": "yes"}, r"clip: expected true or false"),
])
def test_bad_range_keys_are_one_line(mod, kw, message):
    with pytest.raises(RewardError, match=message):
        spec(mod, "length", **kw)


def test_on_error_default_fills_and_counts(mod):
    s = RewardScorer([spec(mod, "boom", on_error={"default": -1.0})])
    r = s.score(["q"] * 3, ["abcd", "xyz", "abcde"], None, {})
    assert r.per_fn["boom"] == [1.0, -1.0, 0.5]
    assert r.errors == {"boom": 1}
    assert r.metrics()["reward/boom/errors"] == 1.0


def test_batch_only_failure_blames_the_batch(mod):
    with pytest.raises(RewardError, match="on the whole batch of 2"):
        RewardScorer([spec(mod, "batch_boom")]).score(["a", "b"], ["x", "y"], None, {})


@pytest.mark.parametrize("name, message", [
    ("short", r"rewards\[0\] 'short' returned 1 values for 2 completions"),
    ("text", r"'text' returned str 'high' at index 0; expected a float or None"),
    ("nan", r"'nan' returned nan at index 0 \(prompt='a', completion='x'\); rewards must be finite"),
])
def test_bad_returns_name_the_function(mod, name, message):
    with pytest.raises(RewardError, match=message):
        RewardScorer([spec(mod, name, on_error={"default": 0.0})]).score(["a", "b"], ["x", "y"], None, {})


def test_length_mismatch_in_inputs(mod):
    with pytest.raises(RewardError, match="column 'answer' has 1 values for 2 completions"):
        RewardScorer([spec(mod, "exact")]).score(["a", "b"], ["x", "y"], None, {"answer": ["x"]})


def test_rewards_run_concurrently(mod):
    specs = [spec(mod, "sleepy", name=f"s{i}") for i in range(3)]
    s = RewardScorer(specs)
    t0 = time.perf_counter()
    r = s.score(["p"], ["c"], None, {})
    elapsed = time.perf_counter() - t0
    assert r.total == [3.0]
    assert elapsed < 2.0, elapsed  # three 1 s rewards, not serialised
    assert all(0.9 < v < 2.0 for v in r.seconds.values())


def test_timeout_stops_or_defaults(mod):
    slow = spec(mod, "sleepy", args={"seconds": 3.0}, timeout_s=0.3)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"'sleepy' timed out after 0.3 s on a batch of 1 samples"):
        RewardScorer([slow]).score(["p"], ["c"], None, {})
    assert time.perf_counter() - t0 < 1.5
    lenient = spec(mod, "sleepy", args={"seconds": 3.0}, timeout_s=0.3, on_error={"default": 0.0})
    r = RewardScorer([lenient]).score(["p", "q"], ["c", "d"], None, {})
    assert r.total == [0.0, 0.0] and r.errors == {"sleepy": 2}


def test_a_reward_that_bounds_each_sample_gets_its_batch_time_and_counts_what_failed(mod, caplog):
    """A function that declares what a batch takes (`batch_seconds`) is waited for that long past
    the spec's `timeout_s` (6 x 0.2 s against 0.3 s), and the samples it scores as `Failed` count
    as errors, said once: the step goes on. In worker processes too."""
    bounded = spec(mod, "each_sleepy", timeout_s=0.3)
    r = RewardScorer([bounded]).score(["p"] * 6, ["late", "ok", "late", "ok", "ok", "ok"], None, {})
    assert r.total == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0] and r.errors == {"each_sleepy": 2}
    assert r.metrics()["reward/each_sleepy/errors"] == 2.0
    said = [rec.getMessage() for rec in caplog.records if "each_sleepy" in rec.getMessage()]
    assert len(said) == 1 and "sample 0" in said[0] and "ran past its limit, scored 0.0" in said[0]
    with RewardScorer([bounded], parallel="process") as s:
        assert s.score(["p"] * 2, ["late", "ok"], None, {}).errors == {"each_sleepy": 1}


def test_failed_samples_count_when_the_batch_is_retried_one_at_a_time(mod):
    """A batch call that raises is retried a sample at a time; a sample the function then scores
    as `Failed` counts as an error like the one that raised alone (before, only the batch path
    counted it)."""
    r = RewardScorer([spec(mod, "failed_or_boom")]).score(["p"] * 3, ["boom", "late", "ok"], None, {})
    assert r.per_fn["failed_or_boom"] == [0.0, 0.0, 1.0] and r.errors == {"failed_or_boom": 2}


def test_process_pool_mode(mod):
    with RewardScorer([spec(mod, "length"), spec(mod, "exact")], parallel="process") as s:
        r = s.score(["p", "q"], ["ab", "c"], None, {"answer": ["ab", "x"]})
    assert r.per_fn == {"length": [2.0, 1.0], "exact": [1.0, 0.0]}


def test_serial_mode_and_collect_errors(mod):
    s = RewardScorer([spec(mod, "boom"), spec(mod, "length")], parallel="none", collect_errors=True)
    r = s.score(["p", "q"], ["xyz", "abcd"], None, {})
    assert r.per_fn["boom"] == [None, 1.0]
    assert [i for i, _ in r.failures["boom"]] == [0]
    assert r.total == [3.0, 5.0]
