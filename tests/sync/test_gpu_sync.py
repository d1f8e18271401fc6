"""The accelerator paths of weight sync, run where a CUDA device is present (skipped on CPU):
NCCL broadcast from learner rank 0 into a separate engine, and a colocated engine that sleeps
(vLLM sleep mode) while its learner trains and then takes the weights in-process."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlkit.sft.objective import NLLObjective
from rlkit.transports import TRANSPORTS, SyncRequest
from tests.sides import hf_logprobs, load_hf, vocab_size

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("ray", "vllm")),
                                 reason="needs Ray and vLLM installed")]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _group(model_dir):
    from rlkit.accel import detect
    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig, RayConfig
    from rlkit.learner.actor import LearnerSpec
    from rlkit.learner.group import LearnerGroup

    spec = LearnerSpec(ModelConfig(path=str(model_dir), dtype="fp32"), "full", None, None,
                       OptimConfig(lr=5e-2, scheduler="constant"), DeepSpeedConfig(zero_stage=0),
                       micro_batch_size=2, grad_accum=1, total_steps=4, seed=0, device="cuda")
    return LearnerGroup(spec, 1, detect("cuda"), RayConfig())


def _train_and_expect(group, model_dir):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab_size(model_dir), (2, 12), generator=gen)
    group.train_step([[{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]],
                     NLLObjective())
    seq = torch.randint(4, vocab_size(model_dir), (16,), generator=gen).tolist()
    reference = load_hf(model_dir)
    reference.load_state_dict({k: v.cpu() for k, v in group.named_weights()}, strict=False)
    return seq, hf_logprobs(reference, seq)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices (learner and engine apart)")
def test_nccl_broadcast_into_separate_engine(ray_local, tiny_models):
    import ray

    from tests.rollout.actors import create_rollout_actor

    model_dir = tiny_models["tiny-untied"]
    group = _group(model_dir)
    engine = create_rollout_actor(str(model_dir), resources={"GPU": 1}, dtype="float32", max_model_len=128,
                                  gpu_memory_utilization=0.3)
    try:
        seq, expected = _train_and_expect(group, model_dir)
        stats = group.push_weights(SyncRequest(TRANSPORTS["broadcast"], [engine], bucket_mib=1.0))[0]
        after = torch.tensor(ray.get(engine.sequence_logprobs.remote([seq]))[0])
        assert stats["buckets"] >= 1 and stats["tensors"] > 0
        assert torch.allclose(after, expected, atol=1e-3), float((after - expected).abs().max())
        group.push_weights(SyncRequest(TRANSPORTS["broadcast"], [engine], bucket_mib=1.0))  # the group is reused
    finally:
        ray.kill(engine)
        group.shutdown()


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
def test_colocated_engine_sleeps_and_takes_weights_in_process(ray_local, tiny_models):
    model_dir = tiny_models["tiny"]
    group = _group(model_dir)
    try:
        import ray

        group.start_engines(str(model_dir), [dict(dtype="float32", max_model_len=128, gpu_memory_utilization=0.3,
                                                  sleep_mode=True)])
        assert ray.get(group.actors[0].generate.remote([[5, 6, 7]], n=2, max_tokens=4, seed=1))
        group.sleep_engines()
        seq, expected = _train_and_expect(group, model_dir)
        group.push_weights(SyncRequest(TRANSPORTS["in_process"]))
        after = torch.tensor(group.engine_sequence_logprobs([seq])[0][0])
        assert torch.allclose(after, expected, atol=1e-3), float((after - expected).abs().max())
    finally:
        group.shutdown()
