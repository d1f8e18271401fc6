"""Rollout engine placement rules that do not need an engine: colocation and sync strategies."""

import pytest

from rlkit import stages
from rlkit.errors import ConfigError


def test_grpo_placement_and_sync_rules(tmp_path):
    from rlkit.accel import detect
    from rlkit.engine.engines import sync_strategy
    from rlkit.errors import UserError

    r = tmp_path / "g.yaml"
    r.write_text("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
                 "rewards: [{fn: 'rewards.exact:exact_match'}]\n")
    cpu = detect("cpu")
    assert sync_strategy(stages.load("grpo", r).rollout, cpu) == "object_store"
    colocated = stages.load("grpo", r, ["rollout.colocate=true", "grpo.num_learners=2", "rollout.num_engines=2",
                                        "grpo.micro_batch_size=4"])
    assert sync_strategy(colocated.rollout, cpu) == "in_process"
    with pytest.raises(ConfigError, match=r"rollout.num_engines: colocated engines are one per learner: set it to "
                                          r"grpo.num_learners \(1\)"):
        stages.load("grpo", r, ["rollout.colocate=true", "rollout.num_engines=2"])
    with pytest.raises(ConfigError, match="grpo.max_staleness: colocated engines share the learners' processes"):
        stages.load("grpo", r, ["rollout.colocate=true", "grpo.max_staleness=1"])
    with pytest.raises(ConfigError, match="grpo.async_generation: this stage does not read it .*max_staleness: 1"):
        stages.load("grpo", r, ["grpo.async_generation=true"])
    with pytest.raises(ConfigError, match="rollout.sync: in_process sync needs colocate: true"):
        stages.load("grpo", r, ["rollout.sync=in_process"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size: colocated engines are one replica"):
        stages.load("grpo", r, ["rollout.colocate=true", "rollout.tensor_parallel_size=2"])
    with pytest.raises(UserError, match="rollout.sync: broadcast needs NCCL/HCCL between devices, but rlkit runs "
                                        "on cpu"):
        sync_strategy(stages.load("grpo", r, ["rollout.sync=broadcast"]).rollout, cpu)
    with pytest.raises(ConfigError, match="eval.samples_per_prompt: must be >= 1, got 0"):
        stages.load("grpo", r, ["eval.samples_per_prompt=0"])


class _Scores:
    """Engines or learners in the sync check: fixed token logprobs per sequence."""

    def __init__(self, per_engine, learner):
        self.per_engine, self.learner = per_engine, learner
        self.names = [f"engine {i}" for i in range(len(per_engine))]

    def sequence_logprobs(self, sequences):
        return self.per_engine if self.learner is None else self.learner


def test_sync_check_names_the_engine_that_disagrees():
    from rlkit.engine.engines import sync_check
    from rlkit.errors import FaultError

    learner = _Scores([], [[-1.0, -2.0], [-0.5]])
    close = [[[-1.0, -2.0 + 2e-6], [-0.5]], [[-1.0 - 4e-6, -2.0], [-0.5]]]
    assert sync_check(_Scores(close, None), learner, [[1, 2, 3], [4, 5]], 1e-3, "after step 3") == \
        pytest.approx(4e-6, rel=0.05)  # float32 tensors
    apart = [close[0], [[-1.0, -2.0], [-0.49]], [[-1.0, -2.2], [-0.5]]]
    with pytest.raises(FaultError, match=r"^sync check after step 3: engine 2 scores the check sequences up to "
                                         r"0\.2 nats away from the learner \(rollout.sync_check_tol 0\.001\)"):
        sync_check(_Scores(apart, None), learner, [[1, 2, 3], [4, 5]], 1e-3, "after step 3")
    nan = [close[0], [[-1.0, float("nan")], [-0.5]]]
    with pytest.raises(FaultError, match="engine 1 scores the check sequences up to nan nats"):
        sync_check(_Scores(nan, None), learner, [[1, 2, 3], [4, 5]], 10.0, "at the start")


def test_sync_check_tolerance_follows_the_model_dtype():
    from rlkit.config import ModelConfig, RolloutConfig
    from rlkit.engine.engines import sync_check_tol

    assert sync_check_tol(RolloutConfig(), ModelConfig(path="m", dtype="fp32")) == 1e-3
    assert sync_check_tol(RolloutConfig(), ModelConfig(path="m", dtype="bf16")) == 0.5
    assert sync_check_tol(RolloutConfig(sync_check_tol=0.02), ModelConfig(path="m", dtype="bf16")) == 0.02
    fp32 = ModelConfig(path="m", dtype="fp32")  # QLoRA: only adapter sync leaves the 4-bit gap
    assert sync_check_tol(RolloutConfig(lora_sync="adapter"), fp32, quantized_learner=True) == 2.0
    assert sync_check_tol(RolloutConfig(), fp32, quantized_learner=True) == 1e-3
