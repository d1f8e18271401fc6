"""Where the teacher runs: beside each learner rank (the default) or in a Ray actor of its own
(`distill.placement: actor`): what each needs of the recipe, the batch and the estimate."""

from __future__ import annotations

import pytest
import torch

from rlkit.config import ModelConfig
from rlkit.grpo.config import DistillConfig, GRPOAlgoConfig
from rlkit.grpo.objective import GRPOObjective
from rlkit.rollout.config import RolloutConfig
from tests.helpers import ROOT


def test_an_actor_teacher_needs_the_sampled_loss_and_a_node_needs_an_actor():
    teacher = ModelConfig(path="teacher")
    with pytest.raises(ValueError, match="placement: actor needs loss: reverse_kl"):
        DistillConfig(teacher, loss="jsd", beta=0.0, placement="actor")
    with pytest.raises(ValueError, match="node: places the teacher's own actor: set placement: actor"):
        DistillConfig(teacher, node="10.0.0.2")
    beside = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(), DistillConfig(teacher))
    apart = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(), DistillConfig(teacher, placement="actor"))
    assert beside.needs == ("teacher_logp",) and apart.needs == ()  # the actor's logprobs come with the batch


def test_the_batch_carries_the_teachers_logprobs_into_each_micro_batch():
    from rlkit.grpo.batch import GRPOBatch, Rollout

    batch = GRPOBatch.collate([Rollout([5, 6, 7], [8, 9], False), Rollout([5], [10, 11, 12, 13], False)],
                              torch.tensor([1.0, -1.0]), pad_id=0)
    logp = torch.arange(2 * (batch.input_ids.shape[1] - 1), dtype=torch.float32).reshape(2, -1)
    mb = GRPOBatch(*[getattr(batch, f) for f in ("input_ids", "attention_mask", "completion_mask", "advantages",
                                                  "engine_logp")], teacher_logp=logp).micro_batch([1])
    assert torch.equal(mb["teacher_logp"], logp[[1], :4])
    assert "teacher_logp" not in batch.micro_batch([1])


def test_the_estimate_gives_an_actor_teacher_its_own_device():
    from rlkit import estimate, stages
    from rlkit.estimate.memory import Hardware, devices_needed

    recipe = ROOT / "recipes" / "r1-distill-opd.yaml"
    beside, apart = (stages.load("distill", recipe, [f"distill.placement={p}"]) for p in ("learner", "actor"))
    arch = estimate.Arch.from_config(*estimate.config_json(beside.model.path))
    hw = Hardware.parse("8xA100-80G")
    kinds = {p.kind: p for p in estimate.estimate(apart, stages.memory("grpo"), arch, hw)}
    learner = {p.kind: p for p in estimate.estimate(beside, stages.memory("grpo"), arch, hw)}["learner rank"]
    assert set(kinds) == {"learner rank", "rollout engine", "teacher"} and kinds["teacher"].count == 1
    assert "teacher copy" in learner.parts and "teacher copy" not in kinds["learner rank"].parts
    assert kinds["teacher"].parts["parameters"] == learner.parts["teacher copy"]  # the 7B teacher, bf16, whole
    assert devices_needed(apart, stages.memory("grpo")) == devices_needed(beside, stages.memory("grpo")) + 1 == 9


def test_a_teacher_node_outside_the_cluster_is_one_line(monkeypatch):
    from rlkit.distill.teacher import check_teacher_node
    from rlkit.errors import ConfigError

    monkeypatch.setattr("rlkit.actors.cluster.cluster_nodes", lambda: {"10.0.0.1": {"CPU": 2}, "10.0.0.2": {}})
    check_teacher_node(DistillConfig(ModelConfig(path="t"), placement="actor", node="10.0.0.2"))
    with pytest.raises(ConfigError, match=r"^distill.node: 10.0.0.9 is not a node of this Ray cluster \(its nodes: "
                                          r"10.0.0.1, 10.0.0.2\)"):
        check_teacher_node(DistillConfig(ModelConfig(path="t"), placement="actor", node="10.0.0.9"))


def test_liger_kernels_for_a_teacher_where_they_cannot_apply_are_one_line(tiny_model):
    from rlkit.accel import detect
    from rlkit.distill.teacher import check_teacher
    from rlkit.errors import UserError

    cpu = detect("cpu")
    check_teacher(ModelConfig(path=str(tiny_model), kernels="auto"), str(tiny_model), cpu)
    with pytest.raises(UserError, match=r"^distill.teacher.kernels: liger runs Triton kernels on a GPU, and this "
                                        r"run's learners are on cpu"):
        check_teacher(ModelConfig(path=str(tiny_model), kernels="liger"), str(tiny_model), cpu)


def test_the_teachers_actor_scores_under_the_objective_and_the_batch_takes_its_rows(tiny_model):
    """The teacher's worker (here without Ray) scores each micro-batch at the objective's
    temperature and positions: an HF forward's logprobs at the completion tokens, 0 at the prompt's;
    `GRPOBatch.scored` sends it micro-batches of tokens and masks only and puts each row's back."""
    from transformers import AutoModelForCausalLM

    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.learner.teacher import TeacherWorker

    worker = TeacherWorker(ModelConfig(path=str(tiny_model), dtype="fp32"), "cpu")
    batch = GRPOBatch.collate([Rollout([5, 6, 7], [8, 9], False), Rollout([5], [10, 11, 12, 13], False),
                               Rollout([4, 4], [20], False)], torch.tensor([1.0, -1.0, 0.5]), pad_id=0)
    sent = []

    def score(micro_batches):
        sent.append([(set(mb), mb["input_ids"].shape[0]) for mb in micro_batches])
        return worker.logprobs(micro_batches, objective)

    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.7, max_tokens=8))
    scored = batch.scored(score, rows=2).teacher_logp
    assert sent == [[({"input_ids", "attention_mask", "completion_mask"}, 2),
                     ({"input_ids", "attention_mask", "completion_mask"}, 1)]]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    for row in range(len(batch)):
        n = int(batch.attention_mask[row].sum())
        ids = batch.input_ids[row, :n]
        with torch.no_grad():
            logits = hf(ids[None]).logits[0, :-1].float() / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
        at = batch.completion_mask[row, 1:n].bool()
        assert torch.allclose(scored[row, :n - 1][at], want[at], atol=1e-4)
        assert not scored[row][~batch.completion_mask[row, 1:].bool()].any()  # prompt and padding: 0
