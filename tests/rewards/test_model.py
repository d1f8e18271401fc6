"""rewards.model: a tiny offline reward model; shapes, determinism, batching."""

import time

import pytest

from rewards.model import RewardModel


def test_scores_shape_determinism_and_batching(tiny_rm):
    prompts = ["1 + 1 =", "hello", "答案是", "the answer is"]
    completions = [" 2", " world world", " 五", " 42 42 42 42"]
    rm = RewardModel(tiny_rm, batch_size=3)
    rm.setup()
    a = rm(prompts, completions)
    assert len(a) == 4 and all(isinstance(x, float) for x in a)
    assert rm(prompts, completions) == a                       # deterministic
    one = RewardModel(tiny_rm, batch_size=1)
    assert one(prompts, completions) == pytest.approx(a, abs=1e-5)   # padding does not change scores
    assert len(set(round(x, 6) for x in a)) > 1                # not constant


def test_chat_messages_and_scorer(tiny_rm):
    from rlkit.reward import RewardScorer, RewardSpec

    s = RewardScorer([RewardSpec(fn="rewards.model:RewardModel", args={"path": tiny_rm, "batch_size": 2})])
    r = s.score([[{"role": "user", "content": "hello"}]] * 3,
                [[{"role": "assistant", "content": c}] for c in ("world", "42", "答案")], None, {})
    assert len(r.total) == 3 and r.errors == {}


def test_a_served_reward_model_tells_the_run_what_its_actor_asks_for(tiny_rm):
    """A reward served from its own Ray actor: the run checks its resources before launch, with the
    learners' and engines' bundles (`RewardScorer.actor_bundles`); in-process it asks for nothing."""
    from rlkit.reward import RewardScorer, RewardSpec

    served = {"path": tiny_rm, "ray_actor": True, "num_cpus": 0.5, "resources": {"rm": 1}}
    s = RewardScorer([RewardSpec(fn="rewards.model:RewardModel", args={"path": tiny_rm}),
                      RewardSpec(fn="rewards.exact:exact_match"),
                      RewardSpec(fn="rewards.model:RewardModel", args=served, name="served")])
    assert s.actor_bundles() == [("rewards[2]", {"CPU": 0.5, "rm": 1.0})]


@pytest.mark.slow
def test_the_served_reward_model_starts_as_a_named_role_with_a_deadline(tiny_rm):
    """Served from its own actor it scores as in-process; a resource no node has is one line before
    any actor starts, and a call past `timeout_s` is one line naming "the reward model"."""
    ray = pytest.importorskip("ray")
    from rlkit.errors import FaultError, UserError

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        local = RewardModel(tiny_rm)(["hello"], [" world"])
        served = RewardModel(tiny_rm, ray_actor=True)
        served.setup()
        assert served._actor is not None
        assert served(["hello"], [" world"]) == pytest.approx(local, abs=1e-5)
        with pytest.raises(UserError, match=r"^the reward model's actor needs \{rm: 1\}; the cluster has \{rm: 0\}"):
            RewardModel(tiny_rm, ray_actor=True, resources={"rm": 1}).setup()
        # a batch of 400 texts cannot be scored in 10 ms: the wait ends there, naming the actor
        late = RewardModel(tiny_rm, ray_actor=True, num_cpus=0, timeout_s=0.01)
        late.setup()
        with pytest.raises(FaultError, match=r"^the reward model did not finish scoring within 0.01 s "
                                             r"\(the reward model's timeout_s\)"):
            late(["hello"] * 400, [" world"] * 400)
        # through the scorer too, at once: not a sample's failure to isolate by calling it 400 times more
        from rlkit.reward import RewardScorer, RewardSpec

        scorer = RewardScorer([RewardSpec(fn="rewards.model:RewardModel", args={
            "path": tiny_rm, "ray_actor": True, "num_cpus": 0, "timeout_s": 0.01})])
        started = time.monotonic()
        with pytest.raises(FaultError, match=r"^the reward model did not finish scoring"):
            scorer.score(["hello"] * 400, [" world"] * 400)
        assert time.monotonic() - started < 30
    finally:
        ray.shutdown()


def test_a_served_reward_model_asks_for_its_accelerators_resource(tiny_rm):
    """`devices` of the device kind it names: GPUs on CUDA and ROCm, NPUs on Ascend, none on a CPU
    (`num_gpus` is the old name of `devices`)."""
    assert RewardModel(tiny_rm, ray_actor=True, device="cuda").ray_resources() == {"CPU": 1.0, "GPU": 1.0}
    assert RewardModel(tiny_rm, ray_actor=True, device="npu", devices=2).ray_resources() == {"CPU": 1.0, "NPU": 2.0}
    assert RewardModel(tiny_rm, ray_actor=True, device="rocm", num_gpus=0.5).ray_resources() == {"CPU": 1, "GPU": 0.5}
    assert RewardModel(tiny_rm, ray_actor=True, num_gpus=1).ray_resources() == {"CPU": 1.0}
    assert RewardModel(tiny_rm).ray_resources() is None
