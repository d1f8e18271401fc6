"""A micro-batch with no position in the loss (every completion truncated and masked, padding-only
rows, a prompt with nothing after it) still gives a loss that backpropagates, with zero gradients:
under DeepSpeed's gradient accumulation every rank runs a backward for every micro-batch, and a
constant loss would stop the run mid-step. Every objective: SFT, each GRPO loss type (with a KL
term, the rollout correction and the off-policy mask), both distillation losses with and
without reward mixing; padded and padding-free; then in real ZeRO-0 and ZeRO-3 learners with
gradient accumulation, an empty micro-batch between normal ones."""

from __future__ import annotations

import pytest
import torch

from rlkit.config import ModelConfig
from rlkit.grpo.batch import GRPOBatch, Rollout
from rlkit.grpo.config import DistillConfig, GRPOAlgoConfig
from rlkit.grpo.loss import LOSS_TYPES
from rlkit.grpo.objective import GRPOObjective
from rlkit.learner.objective import MicroBatch
from rlkit.rollout.config import RolloutConfig
from rlkit.sft.objective import NLLObjective
from tests.sides import load_hf, perturb

PAD = 0


def _grpo(loss_type: str = "dapo", distill: DistillConfig | None = None, **algo) -> GRPOObjective:
    return GRPOObjective.from_config(GRPOAlgoConfig(loss_type=loss_type, **algo),
                                     RolloutConfig(temperature=0.9, max_tokens=8), distill)


def _teacher(loss: str, reward_weight: float) -> DistillConfig:
    return DistillConfig(ModelConfig(path="teacher"), loss=loss, reward_weight=reward_weight,
                         beta=0.5 if loss == "jsd" else 1.0)


OBJECTIVES = {
    **{f"grpo-{t}": _grpo(t, epsilon_high=5.0 if t == "cispo" else 0.28) for t in LOSS_TYPES},
    "grpo-gspo": _grpo("grpo", importance_sampling_level="sequence"),
    "grpo-dapo-kl-bias-corrected": _grpo("dapo", beta=0.04, use_bias_correction_kl=True),
    "grpo-dapo-off-policy-mask": _grpo("dapo", off_policy_mask_threshold=0.5),
    "distill-reverse_kl": _grpo(distill=_teacher("reverse_kl", 0.0)),
    "distill-reverse_kl-with-rewards": _grpo(distill=_teacher("reverse_kl", 1.0)),
    "distill-jsd": _grpo(distill=_teacher("jsd", 0.0)),
    "distill-jsd-with-rewards": _grpo(distill=_teacher("jsd", 0.5)),
}


def _rollouts(empty: bool) -> tuple[list[Rollout], bool]:
    """Two completions; `empty`: both truncated and masked (`grpo.mask_truncated`)."""
    rollouts = [Rollout([5, 6, 7], [8, 9, 10], truncated=empty, logprobs=[-1.0, -2.0, -0.5]),
                Rollout([5, 6], [11, 12, 13, 14], truncated=empty, logprobs=[-0.3, -1.5, -2.0, -1.0])]
    return rollouts, empty


def grpo_micro_batch(empty: bool, packed: bool = False) -> MicroBatch:
    rollouts, masked = _rollouts(empty)
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -1.0]), PAD, mask_truncated=masked)
    mb = batch.packed_micro_batch([0, 1]) if packed else batch.micro_batch([0, 1])
    tokens = batch.completion_tokens()
    return MicroBatch({**mb, "num_items_in_batch": torch.tensor(max(tokens, 1) / 3, dtype=torch.float64)})


def sft_micro_batch(empty: bool) -> MicroBatch:
    """Two rows; `empty`: the first one's response cut away by the cutoff (labels all -100), the
    second padding only."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, PAD, PAD]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = torch.where(attn.bool(), ids, -100)
    labels[:, :2] = -100  # the prompt
    if empty:
        ids[1], attn[1] = PAD, 0
        labels[:] = -100
    return MicroBatch({"input_ids": ids, "attention_mask": attn, "labels": labels})


def _with_frozen(objective, mb: MicroBatch, ref) -> MicroBatch:
    """The logprobs the learner would attach (`needs`), from a frozen model."""
    from rlkit.learner.logprobs import token_logprobs

    for key in objective.needs:
        with torch.no_grad():
            mb = mb.attach(key, token_logprobs(ref, mb, objective.temperature, positions=objective.positions(mb))[0])
    return mb


def _call(name: str, model, teacher, mb):
    objective = NLLObjective() if name == "sft" else OBJECTIVES[name]
    mb = _with_frozen(objective, mb, teacher)
    frozen = {"teacher": teacher} if "teacher" in getattr(objective, "uses", ()) else {}
    return objective(model, mb, **frozen)


@pytest.fixture(scope="module")
def models(tiny_models):
    """The policy, and a teacher / reference a little apart from it (a distillation loss between equal
    models has no gradient)."""
    return load_hf(tiny_models["tiny"]).train(), perturb(load_hf(tiny_models["tiny"]))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["sft", *OBJECTIVES])
def test_an_empty_micro_batch_gives_a_zero_gradient(models, name, packed):
    if name == "sft" and packed:
        pytest.skip("SFT packs rows into one before the learner: an empty packed row is the padded case")
    model, teacher = models
    for empty in (False, True):
        model.zero_grad(set_to_none=True)
        mb = sft_micro_batch(empty) if name == "sft" else grpo_micro_batch(empty, packed)
        loss, metrics = _call(name, model, teacher, mb)
        assert loss.requires_grad, f"{name}: the loss of an {'empty' if empty else 'normal'} micro-batch has no graph"
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        largest = max(float(g.abs().max()) for g in grads)
        if empty:
            assert loss.item() == 0.0 and largest == 0.0
            assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
        else:
            assert largest > 0  # the same objective learns from a normal micro-batch


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_learners_step_over_an_empty_micro_batch(ray_module, tiny_models, zero):
    """Two ZeRO learners, three micro-batches each per step (the middle one empty on one rank, or on
    both): every objective's step completes, counts the three micro-batches and moves the policy."""
    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup

    model_dir = tiny_models["tiny"]
    spec = LearnerSpec(ModelConfig(path=str(model_dir)), "full", None, None,
                       OptimConfig(lr=1e-2, scheduler="constant"), DeepSpeedConfig(zero_stage=zero, dist_timeout_s=120),
                       micro_batch_size=2, grad_accum=3, total_steps=20, seed=0, device="cpu", reference=True,
                       teacher=ModelConfig(path=str(model_dir)))
    group = LearnerGroup(spec, 2, detect("cpu"), RayConfig())
    probe = [5, 6, 7, 8, 9, 10, 11]
    try:
        for name in ("sft", "grpo-dapo-kl-bias-corrected", "grpo-grpo", "distill-reverse_kl-with-rewards",
                     "distill-jsd-with-rewards"):
            make = sft_micro_batch if name == "sft" else grpo_micro_batch
            per_rank = [[make(False), make(True), make(False)], [make(False), make(True), make(True)]]
            before = group.sequence_logprobs([probe])[0]
            results = group.fit([[mbs] for mbs in per_rank], NLLObjective() if name == "sft" else OBJECTIVES[name])
            steps = [r.steps[0] for r in results]  # with the reference's / teacher's logprobs attached first
            after = group.sequence_logprobs([probe])[0]
            assert [s.micro_batches for s in steps] == [3, 3], name
            assert all(s.grad_norm == s.grad_norm and s.grad_norm > 0 for s in steps), name  # finite, not nan
            assert max(abs(a - b) for a, b in zip(after, before)) > 1e-4, f"{name}: the step did not move the policy"
    finally:
        group.shutdown()
