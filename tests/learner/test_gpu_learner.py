"""The learner on a CUDA device, without Ray or vLLM (skipped without CUDA or DeepSpeed).

One NCCL process group of one rank (`process_group` in conftest.py), then `Learner`
directly: bf16 DeepSpeed training at ZeRO 0, 2 and 3 (the SFT NLL falls on a
fixed batch; a GRPO step stays finite), the bf16 logprob path against an fp32 HF forward on the
same weights, the distillation JSD in bf16 against fp32, and `rlkit estimate`'s learner figure
against the memory the learner allocates.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from tests.sides import CUDA_LEARNER_MARKS, CudaPeak, hf_logprobs, learner_estimate, load_hf, vocab_size

SIZE = "25m"  # the largest tiny model (~26M parameters): big enough that bf16 rounding and memory show


pytestmark = CUDA_LEARNER_MARKS


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from rlkit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpu-learner") / SIZE, SIZE)


def _counting_batch(model_dir: Path, rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows that count up from a random start through 32 tokens (token t+1 = token t + 1, wrapping):
    a 32-entry bigram table, learnable in a few steps, so the NLL of a fixed batch falls fast when
    the optimizer works."""
    low, high = 4, min(36, vocab_size(model_dir))
    start = torch.randint(low, high, (rows, 1), generator=torch.Generator().manual_seed(seed))
    ids = low + (start - low + torch.arange(length)) % (high - low)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _random_batch(model_dir: Path, rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, vocab_size(model_dir), (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _nll_steps(learner, batch, steps: int) -> list[float]:
    from rlkit.sft.objective import NLLObjective

    out = []
    for _ in range(steps):
        m = learner.train_step([batch], NLLObjective())
        out.append(m.sums["nll"] / m.sums["tokens"])
    return out


def _param_dtypes(learner) -> set[torch.dtype]:
    return {p.dtype for p in learner.engine.module.parameters()}


# ------------------------------------------------------------------ a. bf16 training per ZeRO stage


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_bf16_learner_trains_sft_and_grpo_at_each_zero_stage(learners, model_dir, zero):
    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.rollout.config import RolloutConfig

    learner, summary = learners(model_dir, zero)
    print(f"\nZeRO-{zero} build summary: {summary}")
    assert summary["precision"] == "bf16" and summary["device"] == "cuda" and summary["zero_stage"] == zero
    if zero < 3:  # (ZeRO-3 partitions the model as it loads: the summary then counts the empty local tensors)
        assert summary["trainable_params"] == summary["total_params"] > 20e6  # full fine-tuning of the 25m model
    assert _param_dtypes(learner) == {torch.bfloat16}
    assert learner.engine.device.type == "cuda"

    losses = _nll_steps(learner, _counting_batch(model_dir, rows=4, length=64), steps=10)
    print(f"\nZeRO-{zero} bf16 SFT NLL per step: " + " ".join(f"{x:.3f}" for x in losses))
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] > 0.8 * math.log(vocab_size(model_dir)), losses  # it starts near uniform
    assert losses[-1] < 0.5 * losses[0], losses  # and learns the fixed batch

    # One GRPO step: 4 completions of two prompts, opposite advantages within each prompt.
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(4, vocab_size(model_dir), (n,), generator=gen).tolist()  # noqa: E731
    prompts = [rand(8), rand(11)]
    rollouts = [Rollout(prompts[i // 2], rand(6 + 3 * i), False) for i in range(4)]
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0)
    mb = {**batch.micro_batch(range(4)), "num_items_in_batch": torch.tensor(float(batch.completion_tokens()))}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=1.0, max_tokens=16))
    positions = mb["completion_mask"][:, 1:].bool()
    before = learner.logprobs([mb], positions=lambda b: b["completion_mask"][:, 1:].bool())[0]
    step = learner.train_step([mb], objective)
    after = learner.logprobs([mb], positions=lambda b: b["completion_mask"][:, 1:].bool())[0]
    metrics = {k: step.mean(k) for k in step.sums}
    print(f"ZeRO-{zero} GRPO step: grad_norm {step.grad_norm:.4f}, " +
          ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    assert {"loss", "ratio_mean", "entropy"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert math.isfinite(step.grad_norm) and step.grad_norm > 0, step.grad_norm
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-2)  # on-policy: the ratio is 1 (bf16 noise aside)
    assert torch.isfinite(after[positions]).all()
    assert (after - before)[positions].abs().max() > 1e-3  # the step changed the policy


# ------------------------------------------------------------------ b. bf16 numerics


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_learner_logprobs_match_fp32_on_the_same_weights(learners, model_dir, zero):
    """The learner's logprobs (bf16 forward, fp32 log-softmax) against an fp32 HF forward on the
    learner's own weights (bf16 values, upcast: only the compute differs).

    Tolerance: bf16 keeps 8 significant bits, a relative rounding of 2**-9 (0.2%) per stored
    activation; a logit of magnitude ~10 then carries ~0.02 nats of rounding from its own storage
    alone, and six layers of bf16 residual stream add their share. A mean error of 0.02 nats and a
    worst token of 0.1 nats are 'bf16 noise'; an fp32 path broken by a wrong cast, a missing
    gather (ZeRO-3) or a wrong position is off by whole nats. The check also asks that the
    training the learner did moves the logprobs 10x more than the bf16 error, so the comparison
    tells models apart. (Measured on an H100, torch 2.11+cu130: max 0.02, mean 0.006 nats.)"""
    learner, _ = learners(model_dir, zero)
    losses = _nll_steps(learner, _counting_batch(model_dir, rows=4, length=64), steps=6)
    assert losses[-1] < losses[0]
    probe = _random_batch(model_dir, rows=4, length=48, seed=7)
    probe["input_ids"][:2] = _counting_batch(model_dir, rows=2, length=48, seed=3)["input_ids"]  # learned rows too
    got = learner.logprobs([probe])[0]  # [4, 47] fp32, CPU
    assert got.dtype == torch.float32

    weights = dict(learner.named_weights())
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # ZeRO-3's HF config would make the reference load partitioned too
    reference = load_hf(model_dir)
    untrained = torch.stack([hf_logprobs(reference, row.tolist()) for row in probe["input_ids"]])
    missing, unexpected = reference.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied embeddings: one tensor for both
    want = torch.stack([hf_logprobs(reference, row.tolist()) for row in probe["input_ids"]])

    diff = (got - want).abs()
    moved = (want - untrained).abs().mean()
    print(f"\nZeRO-{zero} bf16 learner logprobs vs fp32 HF: max abs diff {diff.max():.4f}, mean {diff.mean():.4f}, "
          f"logprob range [{want.min():.2f}, {want.max():.2f}]; training moved them by {moved:.3f} on average")
    assert diff.mean() < 0.02, float(diff.mean())
    assert diff.max() < 0.1, float(diff.max())
    assert moved > 10 * diff.mean(), (float(moved), float(diff.mean()))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_in_bf16_matches_fp32(beta):
    """`generalized_jsd` with bf16 hidden states and heads (the learner's dtype) against the same
    loss in fp32, on CUDA, at a realistic vocabulary (32k) and logit scale (std ~3). The chunk's
    logits are formed in bf16 and upcast before the softmax: each logit carries bf16 rounding
    (2**-9 relative), which the sums over 32k logits and ~400 positions average down; the loss may
    move by well under one rounding step: a relative 2e-3 bound. The student's gradient must point
    the same way (cosine > 0.999) and be as large (norms within 1%). (Measured on an H100, torch
    2.11+cu130: loss rel 3e-5, cosine 0.9999, norm ratio 1.000-1.001.)"""
    from rlkit.distill.loss import generalized_jsd

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H_s, H_t, V = 4, 128, 512, 768, 32000
    h_s = torch.randn(B, T, H_s, generator=g, device="cuda")
    h_t = torch.randn(B, T, H_t, generator=g, device="cuda")
    w_s = torch.randn(V, H_s, generator=g, device="cuda") * (3 / H_s**0.5)
    w_t = w_s @ torch.randn(H_s, H_t, generator=g, device="cuda") / H_s**0.5 + \
        torch.randn(V, H_t, generator=g, device="cuda") * (1 / H_t**0.5)  # a teacher that partly agrees
    mask = (torch.rand(B, T, generator=g, device="cuda") > 0.2).long()

    def run(dtype, inputs=torch.float32):
        cast = lambda t: t.to(inputs).to(dtype)  # noqa: E731 - inputs: the precision the values were rounded to
        hs = cast(h_s).detach().clone().requires_grad_()
        loss, entropy, n = generalized_jsd(hs, cast(h_t), cast(w_s), cast(w_t), mask, beta=beta,
                                           chunk_tokens=96)  # several chunks
        (grad,) = torch.autograd.grad(loss, [hs])
        return loss.detach(), entropy, n, grad.float()

    loss32, ent32, n32, grad32 = run(torch.float32)
    loss16, ent16, n16, grad16 = run(torch.bfloat16)
    rounded = run(torch.float32, inputs=torch.bfloat16)[0]  # fp32 math on the bf16-rounded inputs
    assert loss16.dtype == torch.float32 and int(n16) == int(n32) == int(mask.sum())
    rel = abs(float(loss16) - float(loss32)) / float(loss32)
    cos = torch.nn.functional.cosine_similarity(grad16.flatten(), grad32.flatten(), dim=0)
    norms = float(grad16.norm() / grad32.norm())
    print(f"\nJSD beta={beta}: fp32 {float(loss32):.6f}, bf16 {float(loss16):.6f}, abs diff "
          f"{abs(float(loss16) - float(loss32)):.2e}, rel {rel:.2e}; entropy rel diff "
          f"{abs(float(ent16 - ent32)) / float(ent32):.2e}; grad cosine {float(cos):.5f}, norm ratio {norms:.4f}; "
          f"fp32 math on bf16-rounded inputs {float(rounded):.6f} "
          f"(rel {abs(float(rounded - loss32)) / float(loss32):.2e})")
    assert float(loss32) > 0.05  # a real divergence, not a degenerate zero
    assert rel < 2e-3, rel
    assert abs(float(ent16 - ent32)) / float(ent32) < 2e-3
    assert float(cos) > 0.999 and abs(norms - 1) < 0.01, (float(cos), norms)


# ------------------------------------------------------------------ c. memory against the estimate


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_learner_peak_memory_is_what_rlkit_estimate_says(learners, model_dir, zero):
    """`rlkit estimate` for an SFT recipe of this shape (1 learner, bf16, micro-batch 16 x 256
    tokens, the 25m model, ZeRO `zero`, on 1xH100) against torch's peak allocation over the
    build and three steps. The estimate's "context" part (1 GiB for the CUDA context and the
    allocator's slack) is memory torch's allocator never counts, so it is left out of the
    comparison. Measured on an H100 (torch 2.11): 0.98 (ZeRO-0), 0.99 (ZeRO-2), 1.01 (ZeRO-3, once
    the estimate counted the reduce bucket ZeRO-3 allocates: 1.87 before). The band 0.8-1.25 holds
    the estimate to what a user plans with (a missing DeepSpeed buffer shows)."""
    from rlkit import stages

    micro, length = 16, 256
    cfg = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml", [
        f"model.path={model_dir}", "model.dtype=bf16", "model.build_tiny_if_missing=null",
        f"deepspeed.zero_stage={zero}", "train.num_learners=1", f"train.micro_batch_size={micro}",
        "train.grad_accum=1", f"data.cutoff_len={length}"])
    learner_est, modelled = learner_estimate(cfg, "sft", model_dir)

    with CudaPeak() as memory:
        learner, _ = learners(model_dir, zero, lr=1e-4, micro=micro)
        batch = _random_batch(model_dir, rows=micro, length=length, seed=0)
        losses = _nll_steps(learner, batch, steps=3)
    assert all(math.isfinite(x) for x in losses)
    peak, reserved = memory.peak, memory.reserved
    ratio = peak / modelled
    parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in learner_est.parts.items())
    print(f"\nZeRO-{zero} memory: measured peak allocated {peak / 2**20:.0f} MiB (peak reserved "
          f"{reserved / 2**20:.0f} MiB); estimate {learner_est.total / 2**20:.0f} MiB, "
          f"{modelled / 2**20:.0f} MiB without the context; measured/estimated {ratio:.2f}. "
          f"Estimate parts (MiB): {parts}")
    assert 0.8 < ratio < 1.25, (peak, modelled, learner_est.parts)


# ------------------------------------------------------------------ d. frozen copies and distillation


def test_zero3_bf16_learner_scores_with_whole_reference_and_teacher(learners, model_dir, tmp_path):
    """ZeRO-3 in bf16 on CUDA with a reference and a distillation teacher: both load whole (not
    partitioned by transformers' ZeRO-3 hook), score like an fp32 HF forward of their weights
    within bf16's error, and a GRPO step with the teacher's per-token advantage stays finite."""
    from rlkit.config import ModelConfig
    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import DistillConfig, GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.model.load import whole
    from rlkit.rollout.config import RolloutConfig
    from rlkit.tiny import build_tiny_model

    teacher_dir = build_tiny_model(tmp_path / "teacher", SIZE, seed=1)
    teacher = ModelConfig(path=str(teacher_dir), dtype="bf16")
    learner, _ = learners(model_dir, 3, reference=True, teacher=teacher)
    assert all(p.numel() > 0 for p in learner.teacher.copy.parameters())
    assert all(p.numel() > 0 for p in learner.reference.copy.parameters())
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(4, min(vocab_size(model_dir), vocab_size(teacher_dir)), (48,), generator=gen).tolist()
    mb = {"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, 48, dtype=torch.long)}
    for source, path in (("reference", model_dir), ("teacher", teacher_dir)):
        got = learner.logprobs([mb], model=source)[0][0].float()
        want = hf_logprobs(whole(functools.partial(load_hf, path)), seq)  # (here too the ZeRO-3 hook is on)
        diff = (got - want).abs()
        print(f"\nZeRO-3 bf16 {source} logprobs vs fp32 HF: max abs diff {diff.max():.4f}, mean {diff.mean():.4f}")
        assert diff.mean() < 0.02 and diff.max() < 0.1, (source, float(diff.max()))

    rand = lambda n: torch.randint(4, vocab_size(model_dir), (n,), generator=gen).tolist()  # noqa: E731
    rollouts = [Rollout(rand(8), rand(10), False) for _ in range(4)]
    batch = GRPOBatch.collate(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0)
    mb = {**batch.micro_batch(range(4)), "num_items_in_batch": torch.tensor(float(batch.completion_tokens()))}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(beta=0.01), RolloutConfig(temperature=1.0, max_tokens=16),
                                          DistillConfig(teacher, coef=1.0, reward_weight=0.5))
    fit = learner.fit([[mb]], objective)
    (step,) = fit.steps
    metrics = {k: step.mean(k) for k in step.sums}
    print(f"ZeRO-3 distillation step: grad_norm {step.grad_norm:.4f}, reverse KL {metrics['distill/reverse_kl']:.4f}, "
          f"kl_mean {metrics['kl_mean']:.5f}")
    assert all(math.isfinite(v) for v in metrics.values()) and math.isfinite(step.grad_norm), metrics
    assert metrics["distill/reverse_kl"] != 0.0 and abs(metrics["kl_mean"]) < 1e-2  # two random models differ


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_jsd_distillation_pulls_the_student_to_the_teacher(learners, model_dir, tmp_path, zero):
    """`distill.loss: jsd` in bf16 on CUDA: the student's lm_head (partitioned under ZeRO-3) and the
    whole teacher's project chunk by chunk; on a fixed batch the divergence falls step by step."""
    from rlkit.config import ModelConfig
    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import DistillConfig, GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.rollout.config import RolloutConfig
    from rlkit.tiny import build_tiny_model

    teacher_dir = build_tiny_model(tmp_path / "teacher", SIZE, seed=1)
    teacher = ModelConfig(path=str(teacher_dir), dtype="bf16")
    learner, _ = learners(model_dir, zero, lr=2e-3, teacher=teacher)
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(4, vocab_size(model_dir), (n,), generator=gen).tolist()  # noqa: E731
    batch = GRPOBatch.collate([Rollout(rand(8), rand(24), False) for _ in range(4)], torch.zeros(4), pad_id=0)
    mb = {**batch.micro_batch(range(4)), "num_items_in_batch": torch.tensor(float(batch.completion_tokens()))}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=1.0, max_tokens=24),
                                          DistillConfig(teacher, loss="jsd", beta=0.5))
    values = [learner.fit([[dict(mb)]], objective).steps[0].mean("distill/jsd") for _ in range(8)]
    print(f"\nZeRO-{zero} bf16 JSD on a fixed batch, 8 steps: " + " ".join(f"{v:.4f}" for v in values))
    assert all(math.isfinite(v) for v in values) and values[-1] < 0.7 * values[0], values


def test_teacher_actor_body_scores_in_bf16_like_fp32(model_dir):
    """`distill.placement: actor`: the teacher's worker (here without Ray) loads whole in bf16 on
    CUDA and scores the completion positions like an fp32 HF forward; the prompt's are 0."""
    from rlkit.config import ModelConfig
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.learner.objective import MicroBatch
    from rlkit.learner.teacher import TeacherWorker
    from rlkit.rollout.config import RolloutConfig

    worker = TeacherWorker(ModelConfig(path=str(model_dir), dtype="bf16"), "cuda")
    assert {p.dtype for p in worker.teacher.copy.parameters()} == {torch.bfloat16}
    seq = torch.randint(4, vocab_size(model_dir), (40,), generator=torch.Generator().manual_seed(4)).tolist()
    completion = torch.tensor([[0] * 16 + [1] * 24])
    mb = MicroBatch({"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, 40, dtype=torch.long),
                     "completion_mask": completion})
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.8, max_tokens=24))
    got = worker.logprobs([mb], objective)[0][0]
    want = hf_logprobs(load_hf(model_dir), seq, 0.8)
    diff = (got[15:] - want[15:]).abs()
    print(f"\nteacher actor bf16 vs fp32 HF: max abs diff {diff.max():.4f}, mean {diff.mean():.4f}")
    assert torch.equal(got[:15], torch.zeros(15)) and diff.mean() < 0.02 and diff.max() < 0.1
