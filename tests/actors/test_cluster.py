"""What a run asks of a Ray cluster, without Ray: the placement check on node lists, the join
error, the rendezvous address and the gloo interface (the cross-host runs: tests/e2e/test_multinode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkit.actors.cluster import Demand, interface_of, shortfall
from rlkit.actors.placement import _join_error

NPU8 = {"CPU": 64.0, "NPU": 8.0}


def test_what_fits_is_placed_and_what_does_not_says_why():
    two = {"10.0.0.1": dict(NPU8), "10.0.0.2": dict(NPU8)}
    learners = Demand("learner", 8, {"CPU": 1, "NPU": 1}, "pack", "grpo.num_learners")
    engines = Demand("engine", 2, {"CPU": 1, "NPU": 4}, "pack", "rollout.num_engines")
    assert shortfall([learners, engines], two) is None  # 8 + 8 NPUs on two nodes of 8
    more = Demand("engine", 3, {"CPU": 1, "NPU": 4})
    assert shortfall([learners, more], two) == "NPU 20 in all, the cluster has 16"
    assert shortfall([Demand("engine", 1, {"CPU": 1, "NPU": 16})], two) == \
        "no node holds one engine's bundle {CPU: 1, NPU: 16}"
    # 12 NPUs in all fit the total but not whole bundles: 3 engines of 4 on nodes of 6
    six = {"a": {"CPU": 8.0, "NPU": 6.0}, "b": {"CPU": 8.0, "NPU": 6.0}}
    assert "do not fit whole" in shortfall([Demand("engine", 3, {"CPU": 1, "NPU": 4})], six)
    # the strict strategies
    assert shortfall([Demand("learner", 2, {"CPU": 1, "NPU": 1}, "strict_spread")], two) is None
    assert shortfall([Demand("learner", 3, {"CPU": 1, "NPU": 1}, "strict_spread")], two) == \
        "placement strict_spread needs 3 nodes that each hold {CPU: 1, NPU: 1}"
    assert shortfall([Demand("learner", 8, {"CPU": 1, "NPU": 1}, "strict_pack")], two) is None
    assert shortfall([Demand("learner", 9, {"CPU": 1, "NPU": 1}, "strict_pack")], two) == \
        "placement strict_pack needs one node with {CPU: 9, NPU: 9} for the learners"
    # a GPU recipe on an NPU cluster
    assert shortfall([Demand("learner", 1, {"CPU": 1, "GPU": 1})], two) == "GPU 1 in all, the cluster has 0"


def test_the_recipes_demands_name_their_keys():
    from rlkit import stages
    from rlkit.accel import detect
    from rlkit.grpo.run import demands
    from rlkit.run.driver import learner_demand
    from tests.helpers import ROOT

    cfg = stages.load("grpo", ROOT / "recipes" / "tiny-grpo.yaml", ["ray.placement=spread"])
    got = demands(cfg, detect("cpu"))
    assert [(d.what, d.n, d.bundle, d.placement, d.key) for d in got] == [
        ("learner", 2, {"CPU": 1.0}, "spread", "grpo.num_learners"),
        ("engine", 2, {"CPU": 1.0}, "spread", "rollout.num_engines")]
    colocated = stages.load("grpo", ROOT / "recipes" / "tiny-grpo.yaml", ["rollout.colocate=true"])
    assert [d.what for d in demands(colocated, detect("cpu"))] == ["learner"]
    sft = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", [])
    assert learner_demand(sft, 1, detect("cpu"), "train.num_learners").key == "train.num_learners"


def test_custom_resources_go_into_each_roles_bundles_and_are_checked_before_launch(monkeypatch):
    """`ray.resources.<role>`: the labels a cluster gives its nodes; each actor of the role asks for
    them, the pre-launch check names a resource no node has, and a role that has no actors of its
    own in the run is refused in the recipe."""
    from rlkit import stages
    from rlkit.accel import detect
    from rlkit.actors import cluster
    from rlkit.actors.placement import actor_resources
    from rlkit.errors import ConfigError, UserError
    from rlkit.grpo.run import demands
    from tests.helpers import ROOT

    recipe = ROOT / "recipes" / "tiny-grpo.yaml"
    cfg = stages.load("grpo", recipe, ["ray.resources.learner.judge=1", "ray.resources.engine.fast_disk=0.5"])
    got = demands(cfg, detect("cpu"))
    assert [(d.what, d.bundle, d.custom) for d in got] == [("learner", {"CPU": 1.0, "judge": 1}, ("judge",)),
                                                           ("engine", {"CPU": 1.0, "fast_disk": 0.5}, ("fast_disk",))]
    assert actor_resources(detect("cpu"), 1.0, custom={"judge": 1}) == {"num_cpus": 1.0, "resources": {"judge": 1}}
    nodes = {"10.0.0.1": {"CPU": 4.0}, "10.0.0.2": {"CPU": 4.0, "judge": 1.0}}
    monkeypatch.setattr(cluster, "cluster_nodes", lambda: nodes)
    with pytest.raises(UserError, match=r"^ray.resources.engine: the engines ask for fast_disk 0.5 each and no node "
                                        r"of the Ray cluster has fast_disk \(node 10.0.0.1: \{CPU: 4\}; node "
                                        r"10.0.0.2: \{CPU: 4, judge: 1\}\): start a node with ray start "
                                        r"--resources='\{\"fast_disk\": N\}', or remove it$"):
        cluster.check_resources(got)
    nodes["10.0.0.1"]["fast_disk"] = 2.0
    with pytest.raises(UserError, match=r"judge 2 in all, the cluster has 1"):  # one node labelled, two learners
        cluster.check_resources(got)
    for bad, says in (("ray.resources.learner.GPU=1", "learner.GPU: is set by ray.cpus_per_actor, the device"),
                      ("ray.resources.learner.judge=0", "learner.judge: must be a number > 0, got 0"),
                      ("ray.resources.teacher.judge=1", "ray.resources.teacher: the teacher has an actor of its own "
                                                         "only with distill.placement: actor")):
        with pytest.raises(ConfigError, match=says):
            stages.load("grpo", recipe, [bad])
    with pytest.raises(ConfigError, match="an SFT run has learners only"):
        stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", ["ray.resources.engine.judge=1"])


def test_a_cluster_that_cannot_be_joined_is_one_line():
    class AuthenticationError(Exception):
        pass

    try:
        try:
            raise AuthenticationError("InvalidAuthToken: Authentication token is missing or incorrect")
        except AuthenticationError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from inner
    except ConnectionError as e:
        line = _join_error("10.0.0.1:6379", e)
    assert line.startswith("the Ray cluster at 10.0.0.1:6379 uses token authentication") and "\n" not in line
    line = _join_error("10.0.0.9:6379", ConnectionError("Could not find any running Ray instance.\nPlease ..."))
    assert line.startswith("could not join a Ray cluster at 10.0.0.9:6379: Could not find any running Ray instance.")
    assert "ray start --head" in line and "\n" not in line


def test_rendezvous_is_the_nodes_address_and_gloo_its_interface(ray_local, monkeypatch):
    import ray

    from rlkit.actors.cluster import interface_env, rendezvous

    address, port = rendezvous()
    assert address == ray.util.get_node_ip_address() and address not in ("localhost", "") and port > 0
    # below the kernel's ephemeral range: no outgoing connection takes it before the group binds it
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(20000 <= p < low for _, p in [(address, port), *(rendezvous() for _ in range(5))])
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_env() == {"GLOO_SOCKET_IFNAME": interface_of(address)}
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert interface_env("NCCL_SOCKET_IFNAME") == {"NCCL_SOCKET_IFNAME": interface_of(address)}
    assert interface_of(address) is not None and interface_of("192.0.2.77") is None  # TEST-NET: nobody's
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert interface_env() == {}  # the user's choice stays


@pytest.mark.parametrize("placement", ["pack", "spread", "strict_pack", "strict_spread"])
def test_every_placement_has_its_ray_strategy(placement):
    from rlkit.actors.cluster import STRATEGIES

    assert STRATEGIES[placement] == placement.upper()


def test_only_the_users_own_modules_are_sent_by_value(tmp_path):
    """Installed packages and the standard library are on every node; a reward file next to the
    recipe is sent by value; one that cannot be (not in sys.modules under its name) is one line."""
    import importlib.util
    import json
    import sys

    import ray
    from ray import cloudpickle

    from rlkit.actors.cluster import installed, ship_by_value
    from rlkit.errors import UserError
    from rlkit.reward import RewardSpec
    from rlkit.reward.score import RewardScorer

    assert installed(json) and installed(ray) and installed(pytest)
    (tmp_path / "my_rewards.py").write_text("def helper(c):\n    return 1.0\n\n"
                                            "def fn(completions, **kw):\n    return [helper(c) for c in completions]\n")
    scorer = RewardScorer([RewardSpec(fn="my_rewards.py:fn"), RewardSpec(fn="rewards.exact:exact_match")],
                          base_dir=str(tmp_path))
    mine, library = scorer.modules()
    assert not installed(mine) and library.__name__ == "rewards.exact"
    by_reference = cloudpickle.dumps(mine.fn)
    try:
        assert ship_by_value(scorer.modules()) == [str(tmp_path / "my_rewards.py")]
        by_value = cloudpickle.dumps(mine.fn)
    finally:
        cloudpickle.unregister_pickle_by_value(mine)
    # where the module cannot be imported (a node without the file), only the pickle by value loads
    del sys.modules[mine.__name__]
    try:
        assert cloudpickle.loads(by_value)(["a", "b"]) == [1.0, 1.0]
        with pytest.raises(ModuleNotFoundError):
            cloudpickle.loads(by_reference)
    finally:
        sys.modules[mine.__name__] = mine
    spec = importlib.util.spec_from_file_location("_detached", tmp_path / "my_rewards.py")
    detached = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(detached)
    assert "_detached" not in sys.modules
    with pytest.raises(UserError, match=r"^_detached \(.*my_rewards.py\) cannot be sent to the cluster's nodes: .*"
                                        r"install it on every node"):
        ship_by_value([detached])


def test_inside_a_ray_job_rlkit_leaves_the_jobs_runtime_env_alone(monkeypatch):
    """`ray job submit --runtime-env-json`: what the job sets is not set again by rlkit (Ray would
    refuse the driver), the rest of rlkit's runtime_env stays."""
    import json

    from rlkit.actors.placement import _beside_job

    ours = {"worker_process_setup_hook": "rlkit.console.setup_worker",
            "env_vars": {"OMP_NUM_THREADS": "1", "RLKIT_LOG_DIR": "/runs/x/logs"}}
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert _beside_job(ours) == ours  # not in a job
    job = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "4"}, "worker_process_setup_hook": "mine.hook"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert _beside_job(ours) == {"env_vars": {"RLKIT_LOG_DIR": "/runs/x/logs"}}
