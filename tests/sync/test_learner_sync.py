"""Two DeepSpeed ZeRO-3 learners in Ray train a step, then push into a running vLLM actor:
the engine's logprobs then equal those of the learners' (gathered) weights."""

from __future__ import annotations

import pytest
import torch

from rlkit.sft.objective import NLLObjective
from rlkit.transports import TRANSPORTS, SyncRequest
from tests.sides import hf_logprobs, load_hf, vocab_size

pytestmark = pytest.mark.slow


def _train_one_step(group, model_dir) -> torch.Generator:
    """One SFT step of the two ranks on random token batches; returns the generator for more."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(4, vocab_size(model_dir), (2, 12), generator=gen)
        batches.append([{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}])
    group.train_step(batches, NLLObjective())
    return gen


@pytest.mark.parametrize("size", ["tiny", "tiny-untied"])
def test_zero3_learners_sync_into_vllm(ray_module, tiny_models, size):
    import ray

    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup
    from tests.rollout.actors import create_rollout_actor

    model_dir = tiny_models[size]
    spec = LearnerSpec(ModelConfig(path=str(model_dir)), "full", None, None,
                       OptimConfig(lr=5e-2, scheduler="constant"), DeepSpeedConfig(zero_stage=3),
                       micro_batch_size=2, grad_accum=1, total_steps=4, seed=0, device="cpu")
    group = LearnerGroup(spec, 2, detect("cpu"), RayConfig())
    engine = create_rollout_actor(str(model_dir), dtype="float32", kv_cache_gib=0.25, max_model_len=128)
    try:
        gen = _train_one_step(group, model_dir)

        seq = torch.randint(4, vocab_size(model_dir), (16,), generator=gen).tolist()
        before = torch.tensor(ray.get(engine.sequence_logprobs.remote([seq]))[0])
        # small buckets: several reloads
        stats = group.push_weights(SyncRequest(TRANSPORTS["object_store"], [engine], bucket_mib=0.5))
        after = torch.tensor(ray.get(engine.sequence_logprobs.remote([seq]))[0])

        weights = dict(group.named_weights())
        reference = load_hf(model_dir)
        missing, unexpected = reference.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: one tensor for both
        expected = hf_logprobs(reference, seq)
        assert stats[0]["buckets"] > 1 and stats[1] is None  # rank 0 sends, rank 1 only gathers
        assert (before - expected).abs().max() > 1e-2, "the training step should have changed the policy"
        assert torch.allclose(after, expected, atol=1e-4), float((after - expected).abs().max())
    finally:
        ray.kill(engine)
        group.shutdown()


def test_colocated_engines_take_weights_in_process(ray_module, tiny_models):
    """Two ZeRO-3 learners each host a vLLM engine (external launcher in their torch.distributed
    world); after a training step, every rank's engine holds the gathered policy."""
    import ray

    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup

    model_dir = tiny_models["tiny"]
    spec = LearnerSpec(ModelConfig(path=str(model_dir)), "full", None, None,
                       OptimConfig(lr=5e-2, scheduler="constant"), DeepSpeedConfig(zero_stage=3),
                       micro_batch_size=2, grad_accum=1, total_steps=4, seed=0, device="cpu")
    group = LearnerGroup(spec, 2, detect("cpu"), RayConfig())
    try:
        kwargs = dict(dtype="float32", kv_cache_gib=0.25, max_model_len=128)
        group.start_engines(str(model_dir), [{**kwargs, "seed": r} for r in range(2)])
        gen = _train_one_step(group, model_dir)
        # Ranks generate different amounts: the engines must not wait on each other.
        samples = ray.get([a.generate.remote([[5, 6, 7]] * (1 + r)) for r, a in enumerate(group.actors)])
        assert [len(s) for s in samples] == [1, 2]

        seq = torch.randint(4, vocab_size(model_dir), (16,), generator=gen).tolist()
        before = [torch.tensor(x[0]) for x in group.engine_sequence_logprobs([seq])]
        stats = group.push_weights(SyncRequest(TRANSPORTS["in_process"]))
        after = [torch.tensor(x[0]) for x in group.engine_sequence_logprobs([seq])]

        reference = load_hf(model_dir)
        reference.load_state_dict(dict(group.named_weights()), strict=False)
        expected = hf_logprobs(reference, seq)
        assert all(s["tensors"] > 0 for s in stats)  # every rank loads its own engine
        for b, a in zip(before, after):
            assert (b - expected).abs().max() > 1e-2, "the training step should have changed the policy"
            assert torch.allclose(a, expected, atol=1e-4), float((a - expected).abs().max())
    finally:
        group.shutdown()


def test_zero3_learner_holds_whole_frozen_copies(ray_module, tiny_models):
    """Under ZeRO-3 the policy loads partitioned (transformers' process-wide DeepSpeed hook); the
    reference and the distillation teacher are frozen copies nothing gathers, so each rank must
    hold them whole: their logprobs equal a plain HF forward of their weights."""
    import ray

    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup

    policy, teacher = tiny_models["tiny"], tiny_models["tiny-untied"]
    spec = LearnerSpec(ModelConfig(path=str(policy)), "full", None, None, OptimConfig(lr=5e-2, scheduler="constant"),
                       DeepSpeedConfig(zero_stage=3), micro_batch_size=2, grad_accum=1, total_steps=4, seed=0,
                       device="cpu", reference=True, teacher=ModelConfig(path=str(teacher), dtype="fp32"))
    group = LearnerGroup(spec, 1, detect("cpu"), RayConfig())
    try:
        seq = torch.randint(4, min(vocab_size(policy), vocab_size(teacher)), (16,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        mb = {"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, 16, dtype=torch.long)}
        actor = group.actors[0]
        ref, teach = (ray.get(actor.logprobs.remote([mb], 1.0, source))[0][0] for source in ("reference", "teacher"))
        assert torch.allclose(ref, hf_logprobs(load_hf(policy), seq), atol=1e-5)
        assert torch.allclose(teach, hf_logprobs(load_hf(teacher), seq), atol=1e-5)
    finally:
        group.shutdown()
