"""Rollout engine placement rules that do not need an engine: colocation and sync strategies."""

import pytest

from rlkit import stages
from rlkit.errors import ConfigError


def test_grpo_placement_and_sync_rules(tmp_path):
    from rlkit.accel import detect
    from rlkit.errors import UserError
    from rlkit.rollout.engines import sync_transport

    r = tmp_path / "g.yaml"
    r.write_text("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
                 "rewards: [{fn: 'rewards.exact:exact_match'}]\n")
    cpu = detect("cpu")
    assert sync_transport(stages.load("grpo", r).rollout, cpu).name == "object_store"
    colocated = stages.load("grpo", r, ["rollout.colocate=true", "grpo.num_learners=2", "rollout.num_engines=2",
                                        "grpo.micro_batch_size=4"])
    assert sync_transport(colocated.rollout, cpu).name == "in_process"
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
        sync_transport(stages.load("grpo", r, ["rollout.sync=broadcast"]).rollout, cpu)
    with pytest.raises(ConfigError, match="eval.samples_per_prompt: must be >= 1, got 0"):
        stages.load("grpo", r, ["eval.samples_per_prompt=0"])
    # a LoRA adapter alone is the adapter row's payload: resolved from lora_sync, never named by rollout.sync
    lora = ["finetuning=lora", "lora.r=8", "rollout.lora_sync=adapter"]
    assert sync_transport(stages.load("grpo", r, lora).rollout, cpu).payload.adapter
    assert sync_transport(stages.load("grpo", r, [*lora, "rollout.sync=object_store"]).rollout, cpu).name == "adapter"
    with pytest.raises(ConfigError, match=r"rollout.lora_sync: adapter sync runs with separate engines for now; use "
                                          r"merged with colocate: true$"):
        stages.load("grpo", r, [*lora, "rollout.colocate=true"])
    with pytest.raises(ConfigError, match=r"rollout.sync: with lora_sync: adapter, the sync is the LoRA adapter "
                                          r"alone through the Ray object store, .*: use sync: auto$"):
        stages.load("grpo", r, [*lora, "rollout.sync=broadcast"])
    with pytest.raises(ConfigError, match=r"rollout.sync: .*'adapter'"):
        stages.load("grpo", r, ["rollout.sync=adapter"])


class _Scores:
    """Engines or learners in the sync check: fixed token logprobs per sequence."""

    def __init__(self, per_engine, learner):
        self.per_engine, self.learner = per_engine, learner
        self.names = [f"engine {i}" for i in range(len(per_engine))]

    def sequence_logprobs(self, sequences, pixels=None):
        return self.per_engine if self.learner is None else self.learner


def test_sync_check_names_the_engine_that_disagrees():
    from rlkit.errors import FaultError
    from rlkit.grpo.parity import Probe, SyncTolerance, sync_check

    fp32 = SyncTolerance(1e-3, "max")
    learner = _Scores([], [[-1.0, -2.0], [-0.5]])
    close = [[[-1.0, -2.0 + 2e-6], [-0.5]], [[-1.0 - 4e-6, -2.0], [-0.5]]]
    largest, mean = sync_check(_Scores(close, None), learner, Probe([[1, 2, 3], [4, 5]]), fp32, "after step 3")
    assert largest == pytest.approx(4e-6, rel=0.05) and mean == pytest.approx(4e-6 / 3, rel=0.05)  # float32
    apart = [close[0], [[-1.0, -2.0], [-0.49]], [[-1.0, -2.2], [-0.5]]]
    with pytest.raises(FaultError, match=r"^sync check after step 3: engine 2 scores the check sequences up to "
                                         r"0\.2 nats away from the learner \(rollout.sync_check_tol 0\.001, on "
                                         r"the max difference\)"):
        sync_check(_Scores(apart, None), learner, Probe([[1, 2, 3], [4, 5]]), fp32, "after step 3")
    nan = [close[0], [[-1.0, float("nan")], [-0.5]]]
    with pytest.raises(FaultError, match="engine 1 scores the check sequences up to nan nats"):
        sync_check(_Scores(nan, None), learner, Probe([[1, 2, 3], [4, 5]]), SyncTolerance(10.0, "max"), "at the start")
    longer = [close[0], [[-1.0, -2.0, -3.0], [-0.5]]]  # expanded a prompt's image into one more token
    with pytest.raises(FaultError, match=r"^sync check at the start: engine 1 reads check prompt 1 as 4 tokens and "
                                         r"the learner as 3: the engine and the model's processor expand"):
        sync_check(_Scores(longer, None), learner, Probe([[1, 2, 3], [4, 5]]), fp32, "at the start")


def test_half_precision_sync_check_bounds_the_mean_gap():
    """bf16 kernels put single tokens ~0.6 nats apart on a correct sync (SmolLM2-135M at the start):
    the probe bounds the mean gap there, so one outlier token passes and a shifted engine does not."""
    from rlkit.errors import FaultError
    from rlkit.grpo.parity import Probe, SyncTolerance, sync_check

    bf16 = SyncTolerance(0.1, "mean")
    learner = _Scores([], [[-1.0] * 19, [-0.5]])
    outlier = [[[-1.0] * 18 + [-1.6], [-0.5]]]                    # one token 0.6 nats off, the mean 0.03
    assert sync_check(_Scores(outlier, None), learner, Probe([[1] * 20, [2]]), bf16, "at the start") == \
        pytest.approx((0.6, 0.03), rel=1e-4)
    shifted = [outlier[0], [[-1.3] * 19, [-0.8]]]                 # every token 0.3 nats off: not the policy
    with pytest.raises(FaultError, match=r"^sync check after step 2: engine 1 scores the check sequences 0\.3 "
                                         r"nats away on average \(up to 0\.3\) from the learner \(rollout\."
                                         r"sync_check_tol 0\.1, on the mean difference\)"):
        sync_check(_Scores(shifted, None), learner, Probe([[1] * 20, [2]]), bf16, "after step 2")
    with pytest.raises(FaultError, match="engine 0 scores"):     # the fp32 rule would stop at the outlier
        sync_check(_Scores(outlier, None), learner, Probe([[1] * 20, [2]]), SyncTolerance(0.5, "max"), "at the start")


def test_sync_check_tolerance_follows_the_model_dtype():
    from rlkit.config import ModelConfig
    from rlkit.grpo.parity import SyncTolerance, sync_check_tol
    from rlkit.rollout.config import RolloutConfig
    from rlkit.transports import TRANSPORTS

    weights, adapter = TRANSPORTS["object_store"], TRANSPORTS["adapter"]
    assert sync_check_tol(RolloutConfig(), ModelConfig(path="m", dtype="fp32"), weights) == SyncTolerance(1e-3, "max")
    assert sync_check_tol(RolloutConfig(), ModelConfig(path="m", dtype="bf16"), weights) == SyncTolerance(0.2, "mean")
    assert sync_check_tol(RolloutConfig(sync_check_tol=0.02), ModelConfig(path="m", dtype="bf16"), weights) == \
        SyncTolerance(0.02, "mean")
    fp32 = ModelConfig(path="m", dtype="fp32")  # QLoRA: only a row that moves the adapter leaves the 4-bit gap
    assert sync_check_tol(RolloutConfig(lora_sync="adapter"), fp32, adapter, quantized_learner=True) == \
        SyncTolerance(2.0, "max")
    assert sync_check_tol(RolloutConfig(), fp32, weights, quantized_learner=True) == SyncTolerance(1e-3, "max")
