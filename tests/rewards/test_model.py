"""rewards.model: a tiny offline reward model; shapes, determinism, batching."""

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
def test_ray_actor(tiny_rm):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        local = RewardModel(tiny_rm)(["hello"], [" world"])
        served = RewardModel(tiny_rm, ray_actor=True)
        served.setup()
        assert served._actor is not None
        assert served(["hello"], [" world"]) == pytest.approx(local, abs=1e-5)
        # a resource no node has: one line, not an actor that waits forever
        with pytest.raises(ValueError, match=r"the reward model's actor needs \{'rm': 1\}; the cluster has "
                                             r"\{'rm': 0\}"):
            RewardModel(tiny_rm, ray_actor=True, resources={"rm": 1}).setup()
    finally:
        ray.shutdown()
