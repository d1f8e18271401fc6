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
