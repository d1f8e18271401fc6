"""rlkit on a two-host Ray cluster (`tests/cluster.py`: each host a network namespace with its own
address, a Ray node in each): DeepSpeed learners on different hosts rendezvous at rank 0's host
address, engines on the other host get the weights, GRPO learns; SFT ZeRO-2 and ZeRO-3 across
hosts, stopped and resumed, give the single-host loss curve; the checks before launch (resources,
a node that does not see output_dir, a cluster with token authentication) give their one line; a
reward module of the user's and a reward model's actor work on host B; `ray job submit` runs rlkit;
a lost node is one line and the run resumes when it is back.

Host A (10.213.7.1, 1 CPU) runs the driver and the Ray head; host B (10.213.7.2, 2 CPUs). With
`ray.placement=strict_spread` the two learners take one host each, so an engine can only go to
host B. Host B has a folder of its own (`private`): what a node without the shared filesystem sees.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import NetnsCluster
from tests.helpers import GRPO_RECIPE, ROOT, grpo_overrides, sft_overrides

WHY_NOT = NetnsCluster.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}")]

SFT_RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
RLKIT = [sys.executable, "-m", "rlkit.cli"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    private = tmp_path_factory.mktemp("host-b-own")
    # host B also has a custom resource `judge`: the reward's own actor goes there
    cluster = NetnsCluster(hosts=2, cpus=[1, 2], resources={1: {"judge": 2}}, private={1: [str(private)]},
                           dashboard=True, cwd=tmp_path_factory.mktemp("raylet-cwd"))
    try:
        cluster.start()
        cluster.own_folder = private  # host B's alone
        yield cluster
    finally:
        cluster.close()


def _rlkit(hosts: NetnsCluster, *args: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """An rlkit command on host A, joined to the cluster."""
    return hosts.run(0, [*RLKIT, *args, "--address", hosts.head], timeout=timeout, cwd=ROOT, **kw)


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _one_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in res.stderr.splitlines() if x.startswith("rlkit: error:")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


RLKIT_LINE = re.compile(r"^(rlkit[ :]|step \d+/\d+ )")  # rlkit's own lines: its messages and the progress
LEARNER_LINE = re.compile(r"^rlkit: learner rank (\d+) of \d+ on node (\S+): \w+ process group at ([^\s,]+)")


def _learner_nodes(run: Path) -> dict[int, tuple[str, str]]:
    """rank -> (its node, the process group's address), from the learners' own logs."""
    out = {}
    for log in sorted((run / "logs").glob("learner-*.log")):
        for line in log.read_text().splitlines():
            if m := LEARNER_LINE.match(line):
                out[int(m[1])] = (m[2], m[3])
    return out


def test_grpo_learns_with_learners_on_two_hosts_and_the_engine_on_the_second(hosts, sft_model, task_data, tmp_path):
    out = tmp_path / "grpo"
    res = _rlkit(hosts, "grpo", str(GRPO_RECIPE), *grpo_overrides(
        sft_model, task_data, out, "grpo.num_learners=2", "deepspeed.zero_stage=2", "ray.placement=strict_spread",
        "grpo.steps=24", "eval.every=12", "checkpoint.every=0", "curriculum.enabled=false",
        "rollout.sync_check_every=12"))
    assert res.returncode == 0, res.stderr[-3000:]
    # one learner on each host; both joined the group rank 0 hosts at its host address, not localhost
    nodes = _learner_nodes(out)
    assert sorted(n for n, _ in nodes.values()) == hosts.addresses, nodes
    master = nodes[0][1].rsplit(":", 1)[0]
    assert master == nodes[0][0] and all(addr.startswith(master + ":") for _, addr in nodes.values()), nodes
    log = (out / "rlkit.log").read_text()
    assert re.search(rf"engine 0: pid \d+ on node {re.escape(hosts.addresses[1])}$", log, re.M), log[-2000:]
    # weights crossed hosts every step (object store), and the engine agrees with the learner
    rows = _rows(out)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 24 and all(r["sync/mib"] > 0 for r in steps)
    checks = [r["sync/check_abs_diff_max"] for r in rows if "sync/check_abs_diff_max" in r]
    assert checks and max(checks) < 1e-4, checks
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    assert len(evals) == 3 and evals[-1] > evals[0] + 0.05, f"held-out exact-answer accuracy did not rise: {evals}"
    assert (out / "final" / "model.safetensors").is_file()


def test_ray_job_submit_runs_rlkit_across_the_hosts(hosts, tiny_model, task_data, tmp_path):
    """`ray job submit -- rlkit grpo ...` on host A: the entrypoint joins the cluster its job runs
    in (RAY_ADDRESS, no --address), beside the job's own runtime_env (it sets OMP_NUM_THREADS, as
    rlkit does: Ray refuses a driver that sets it again), with a learner on each host."""
    out = tmp_path / "run"
    entry = [*RLKIT, "grpo", str(GRPO_RECIPE), *grpo_overrides(
        tiny_model, task_data, out, "grpo.num_learners=2", "ray.placement=strict_spread", "grpo.steps=2",
        "eval.every=0", "checkpoint.every=0")]
    res = hosts.run(0, [hosts.env["RAY"], "job", "submit", "--address", "http://127.0.0.1:8265",
                        "--runtime-env-json", json.dumps({"env_vars": {"OMP_NUM_THREADS": "1"}}), "--", *entry],
                    timeout=600, cwd=ROOT)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "succeeded" in text, text[-3000:]
    assert "rlkit grpo:" in text  # rlkit's own lines reach the job's log
    assert sorted(n for n, _ in _learner_nodes(out).values()) == hosts.addresses
    assert len([r for r in _rows(out) if "reward/mean" in r]) == 2
    assert (out / "final" / "model.safetensors").is_file()


JUDGE = """
import ray


@ray.remote(num_cpus=0, resources={"judge": 1})
class Judge:
    def where(self):
        return ray.util.get_node_ip_address()

    def score(self, completions, answer):
        return [same(c, a) for c, a in zip(completions, answer)]


def same(completion, answer):  # a helper of this module the actor calls: the worker must have the module
    text = completion[0]["content"] if isinstance(completion, list) else completion
    return float(text.strip() == answer)


class JudgeReward:
    \"\"\"Exact match, scored by an actor of this file's own class on the node with `judge`.\"\"\"

    def __init__(self, record: str):
        self.record = record

    def setup(self):
        self.judge = Judge.remote()
        with open(self.record, "w") as f:
            f.write(ray.get(self.judge.where.remote()))

    def __call__(self, completions, answer, **kwargs):
        return ray.get(self.judge.score.remote(list(completions), list(answer)))
"""


def test_a_reward_module_next_to_the_recipe_runs_its_actor_on_the_other_host(hosts, sft_model, task_data, tmp_path):
    """`my_rewards.py:JudgeReward` next to the recipe starts an actor of its own class on host B.
    The recipe's folder is one host B does not have (its own folder), so the module cannot be
    imported there: rlkit sends it by value and says so (without that, the actor dies on import).
    A reward model served by `rewards.model:RewardModel`'s actor goes to host B as well."""
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    rm = tmp_path / "rm"
    Qwen2ForSequenceClassification.from_pretrained(sft_model, num_labels=1).save_pretrained(rm)
    AutoTokenizer.from_pretrained(sft_model).save_pretrained(rm)
    recipe = hosts.own_folder / tmp_path.name / "grpo.yaml"
    recipe.parent.mkdir()
    recipe.write_text(GRPO_RECIPE.read_text())
    (recipe.parent / "my_rewards.py").write_text(JUDGE)
    record, out = tmp_path / "judge-node.txt", tmp_path / "run"
    rewards = (f"rewards=[{{fn: 'my_rewards.py:JudgeReward', args: {{record: '{record}'}}, weight: 1.0}}, "
               "{fn: 'rewards.exact:exact_match', weight: 0.0}, {fn: 'rewards.model:RewardModel', weight: 0.0, "
               f"args: {{path: '{rm}', ray_actor: true, num_cpus: 0, resources: {{judge: 1}}}}}}]")
    res = _rlkit(hosts, "grpo", str(recipe), *grpo_overrides(sft_model, task_data, out, "grpo.steps=3", "eval.every=0",
                                                              "checkpoint.every=0", rewards), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert record.read_text() == hosts.addresses[1]  # the judge ran on host B
    assert "reward modules go to the Ray workers by value" in res.stderr and "my_rewards.py" in res.stderr
    rows = [r for r in _rows(out) if "reward/mean" in r]
    # the judge's score is the exact match's, computed there
    assert len(rows) == 3 and all(r["reward/JudgeReward/mean"] == r["reward/exact_match/mean"] for r in rows), rows
    # the reward model scored every step from its actor, which only host B (`judge`) could hold
    assert all(math.isfinite(r["reward/RewardModel/mean"]) for r in rows), rows


def test_sft_zero_on_two_hosts_stopped_and_resumed_matches_one_host(hosts, tiny_model, task_data, tmp_path):
    """Two ZeRO-3 learners on two hosts (each writes its parameter and optimizer shards from its own
    host), stopped by SIGTERM after step 4 and resumed (`resume: auto`), give the loss curve of two
    learners on one host run without a stop. (ZeRO-2 on two hosts resumes in the lost-node test.)
    The two-host run names its model and output_dir relative to the folder it runs in: the raylets
    work in another one, and every shard, checkpoint and final/ lands in the driver's."""
    keys = ["train.num_learners=2", "deepspeed.zero_stage=3", "train.max_steps=10", "train.micro_batch_size=8",
            "optim.scheduler=constant", "eval.every=0", "checkpoint.every=2", "logging.every=1"]
    one = tmp_path / "one-host"
    res = subprocess.run([*RLKIT, "sft", str(SFT_RECIPE), *sft_overrides(tiny_model, task_data, one, *keys)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=hosts.env)
    assert res.returncode == 0, res.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(tiny_model)
    two = work / "runs" / "two-hosts"
    args = [*RLKIT, "sft", str(SFT_RECIPE), *sft_overrides("model", task_data, "runs/two-hosts", *keys,
                                                           "ray.placement=strict_spread"), "--address", hosts.head]
    run = hosts.popen(0, args, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((two / "metrics.jsonl").exists() and any(r.get("step", 0) >= 4 for r in _rows(two))):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 3, err[-3000:]  # stopped after a checkpoint
    stopped_at = max(r["step"] for r in _rows(two) if "train/loss" in r)
    assert 4 <= stopped_at < 10
    res = hosts.run(0, args, cwd=work, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resum" in (res.stdout + res.stderr).lower()
    assert sorted(n for n, _ in _learner_nodes(two).values()) == hosts.addresses
    assert (two / "final" / "model.safetensors").is_file() and not list(Path(hosts.cwd).iterdir())
    assert yaml.safe_load((two / "config.yaml").read_text())["output_dir"] == str(two)
    want = {r["step"]: r["train/loss"] for r in _rows(one) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in _rows(two) if "train/loss" in r}  # the resumed steps last
    assert sorted(want) == sorted(got) == list(range(1, 11))
    assert all(abs(got[s] - want[s]) <= 1e-5 * max(1.0, abs(want[s])) for s in want), (want, got)


def test_learners_go_where_their_custom_resource_is(hosts, tiny_model, task_data, tmp_path):
    """`ray.resources.learner`: both learners on the host that has the custom resource (a
    stand-in for an accelerator Ray does not know; spread alone would use both hosts)."""
    out = tmp_path / "judge"
    res = _rlkit(hosts, "sft", str(SFT_RECIPE), *sft_overrides(
        tiny_model, task_data, out, "train.num_learners=2", "train.max_steps=2", "eval.every=0",
        "checkpoint.every=0", "ray.placement=spread", "ray.resources.learner.judge=1"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {n for n, _ in _learner_nodes(out).values()} == {hosts.addresses[1]}  # host B has `judge`


def test_what_the_cluster_cannot_do_is_one_line_before_launch(hosts, tiny_model, task_data, tmp_path):
    """Each command stops before anything starts: they run at once (each its own output_dir)."""
    from concurrent.futures import ThreadPoolExecutor

    def sft(name: str, *extra: str, out=None) -> list[str]:
        return ["sft", str(SFT_RECIPE), *sft_overrides(tiny_model, task_data, out or tmp_path / name,
                                                        "train.max_steps=2", "eval.every=0"), *extra]

    grpo = grpo_overrides(tiny_model, task_data, tmp_path / "grpo", "grpo.steps=1", "eval.every=0",
                          "rewards=[{fn: 'rewards.exact:exact_match'}, {fn: 'rewards.model:RewardModel', weight: 0.0, "
                          f"args: {{path: '{tiny_model}', ray_actor: true, num_cpus: 0, resources: {{rm: 1}}}}}}]")
    commands = {
        # three learners, one per node, on two nodes; four learners on three CPUs
        "spread": (sft("spread", "train.num_learners=3", "ray.placement=strict_spread"), {}),
        "cpus": (sft("cpus", "train.num_learners=4"), {}),
        # a reward model's actor asking for a resource no node has: before launch too, naming its key
        "reward": (["grpo", str(GRPO_RECIPE), *grpo], {}),
        # a custom resource no node has (an accelerator Ray does not know, here)
        "npu": (sft("npu", "ray.resources.learner.NPU=1"), {}),
        # output_dir in a folder host B does not share: its learner could not write its shards there
        "own": (sft("own", "train.num_learners=2", "ray.placement=strict_spread", out=hosts.own_folder / "run"), {}),
        # a client without the cluster's token
        "token": (sft("token"), {"RAY_AUTH_MODE": "disabled"}),
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        running = {k: pool.submit(_rlkit, hosts, *args, timeout=300, env=env) for k, (args, env) in commands.items()}
        line = {k: _one_line(f.result()) for k, f in running.items()}
    assert "cannot place this run: it asks for 3 learners x {CPU: 1} (strict_spread)" in line["spread"]
    assert f"node {hosts.addresses[0]}: {{CPU: 1}}; node {hosts.addresses[1]}: {{CPU: 2, judge: 2}}" in line["spread"]
    assert "CPU 4 in all, the cluster has 3" in line["cpus"]
    assert line["reward"].startswith("rlkit: error: rewards[1].args.resources: the reward actors ask for rm 1 each "
                                     "and no node of the Ray cluster has rm ("), line["reward"]
    assert line["npu"].startswith("rlkit: error: ray.resources.learner: the learners ask for NPU 1 each and no node "
                                  f"of the Ray cluster has NPU (node {hosts.addresses[0]}: {{CPU: 1}}; node "
                                  f"{hosts.addresses[1]}: {{CPU: 2, judge: 2}}): start a node with ray start "
                                  "--resources="), line["npu"]
    want = f"Ray node {hosts.addresses[1]} (it hosts learners) does not see output_dir {hosts.own_folder / 'run'}"
    assert want in line["own"]
    assert "uses token authentication" in line["token"] and "RAY_AUTH_TOKEN_PATH" in line["token"]


def test_a_lost_node_ends_the_run_in_one_line_and_the_run_resumes_when_it_is_back(hosts, sft_model, task_data,
                                                                                   tmp_path):
    """Host B (a learner and the engine) leaves mid-run: the run stops with one line naming the
    node and what it hosted (not a learner waiting out gloo's timeout, nor an engine restarted
    into a bundle no node holds); when host B is back, the same command resumes and finishes."""
    out = tmp_path / "lost"
    args = [*RLKIT, "grpo", str(GRPO_RECIPE), *grpo_overrides(
        sft_model, task_data, out, "grpo.num_learners=2", "deepspeed.zero_stage=2", "ray.placement=strict_spread",
        "grpo.steps=12", "eval.every=0", "checkpoint.every=2", "curriculum.enabled=false"), "--address", hosts.head]
    run = hosts.popen(0, args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and sum(1 for r in _rows(out) if "reward/mean" in r) >= 4):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    lost_at = time.monotonic()
    hosts.stop_node(1)
    out_, err = run.communicate(timeout=240)
    took = time.monotonic() - lost_at
    print(f"\nthe run stopped {took:.1f} s after host B left")
    line = _one_line(subprocess.CompletedProcess(args, run.returncode, "", err))
    assert f"Ray node {hosts.addresses[1]} left the cluster during" in line and "it hosted" in line, line
    # Ray's own "(raylet) ... has been marked dead" goes to logs/driver.log: the console is rlkit's
    assert [x for x in (out_ + err).splitlines() if not RLKIT_LINE.match(x)] == [], out_ + err
    assert "marked dead" in (out / "logs" / "driver.log").read_text()
    assert "is intact: rerun the same command to resume from it" in line, line
    assert took < 120, took  # Ray marks a node dead after missed heartbeats; gloo alone would wait 600 s
    saved = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    hosts.start_node(1)
    res = hosts.run(0, args, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{saved}'}" in res.stdout + res.stderr
    steps = [r["step"] for r in _rows(out) if "reward/mean" in r]
    assert steps == list(range(1, 13)), steps  # the records after the checkpoint were dropped and done again
    assert (out / "final" / "model.safetensors").is_file()


def test_a_learner_on_a_host_cut_off_from_the_network_ends_once_ray_would_give_its_head_up(hosts, tiny_model,
                                                                                          task_data, tmp_path):
    """Host B's link goes down during SFT: its Ray node stays up and keeps the learner it hosts,
    blocked in a collective, after the driver has stopped (over 150 s, measured before the
    watch). The learner ends itself once the head has been unreachable for as long as Ray waits for
    it (Ray's GCS reconnect window: 30 s on this cluster, 60 by default), not its collective timeout
    (deepspeed.dist_timeout_s, 600 s: a slow collective is not a lost head), saying so in its log; the
    driver stops in one line as for a lost node."""
    out, limit = tmp_path / "cut", float(hosts.env["RAY_gcs_rpc_server_reconnect_timeout_s"])
    args = [*RLKIT, "sft", str(SFT_RECIPE), *sft_overrides(
        tiny_model, task_data, out, "train.num_learners=2", "deepspeed.zero_stage=2", "train.max_steps=200",
        "eval.every=0", "checkpoint.every=0", "ray.placement=strict_spread", "deepspeed.dist_timeout_s=600"),
        "--address", hosts.head]
    run = hosts.popen(0, args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and len(_rows(out)) >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    actors = {pid: cmd for pid, cmd in hosts.processes(1).items() if cmd.startswith("ray::Learner")}
    assert len(actors) == 1, hosts.processes(1)  # strict_spread: one learner on each host
    cut_at = time.monotonic()
    hosts.cut(1)
    try:
        while any(pid in hosts.processes(1) for pid in actors) and time.monotonic() - cut_at < limit + 30:
            time.sleep(0.5)
        took = time.monotonic() - cut_at
        _, err = run.communicate(timeout=240)
    finally:
        hosts.reconnect(1)
        hosts.stop_node(1)  # Ray has marked the node dead: it joins again as a new one
        hosts.start_node(1)
    print(f"\nthe learner on the cut-off host ended {took:.1f} s after the cut")
    assert limit <= took < limit + 30, took
    line = _one_line(subprocess.CompletedProcess(args, run.returncode, "", err))
    assert f"Ray node {hosts.addresses[1]} left the cluster during" in line, line
    said = "".join(p.read_text() for p in (out / "logs").glob("learner-*.log"))
    assert f"the cluster's head at {hosts.head} has not been reachable for {limit:.0f} s (Ray's reconnect window): " \
           "this host is cut off, and the process ends" in said, said[-2000:]


def test_a_distillation_teacher_on_the_other_host_scores_as_the_copy_beside_the_learner(hosts, tiny_model, sft_model,
                                                                                        task_data, tmp_path):
    """`distill.placement: actor` with `distill.node` = host B: the teacher's own actor runs there and
    the driver attaches its logprobs to the batch; from the same samples the first step's sampled
    KL equals that of the teacher copy held beside the learner. A node the cluster lacks is one
    line before launch."""
    def distill(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return _rlkit(hosts, "distill", str(ROOT / "recipes" / "tiny-distill.yaml"), f"model.path={tiny_model}",
                      f"distill.teacher.path={sft_model}", f"data.train={task_data['sft_train']}", "data.eval=null",
                      "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
                      "logging.tensorboard=false", "distill.loss=reverse_kl", "distill.beta=1.0", "grpo.steps=1",
                      "grpo.prompts_per_step=8", "grpo.micro_batch_size=16", "eval.every=0", "checkpoint.every=0",
                      "ray.cpus_per_actor=0.5", *extra, timeout=600)

    from concurrent.futures import ThreadPoolExecutor

    kl = {}
    with ThreadPoolExecutor(1) as pool:  # the command that stops before launch runs beside the first run
        nowhere = pool.submit(distill, tmp_path / "nowhere", "distill.placement=actor", "distill.node=10.213.7.9")
        for placement, extra in (("learner", []), ("actor", [f"distill.node={hosts.addresses[1]}"])):
            out = tmp_path / placement
            res = distill(out, f"distill.placement={placement}", *extra)
            assert res.returncode == 0, res.stderr[-3000:]
            (row,) = [r for r in _rows(out) if "train/distill/reverse_kl" in r]
            kl[placement] = row["train/distill/reverse_kl"]
            assert ("time/teacher" in row) == (placement == "actor")
        line = _one_line(nowhere.result())
    log = (tmp_path / "actor" / "rlkit.log").read_text()
    assert f"the teacher runs in its own actor on node {hosts.addresses[1]}" in log
    assert kl["actor"] == pytest.approx(kl["learner"], rel=1e-4) and kl["actor"] > 0.1, kl
    assert line == (f"rlkit: error: distill.node: 10.213.7.9 is not a node of this Ray cluster (its nodes: "
                    f"{', '.join(hosts.addresses)}): give one of those addresses, or null to let Ray place the teacher")
