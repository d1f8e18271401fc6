"""Streaming generation inside a rollout engine (`grpo.streaming`): groups go in as the driver
assigns them, a group comes out as soon as all its samples are done, and new weights load between
the engine's steps while samples are still running (partial rollouts).

The engine is stepped by hand (vLLM's `LLMEngine.add_request` / `step`), a budget of seconds per
call, so the actor stays free between calls for the driver's next call and the weight sync's loads.
Each group is one request of `n` samples whose output comes back whole once its last sample ends
(`FINAL_ONLY`), with the seeds `generate` gives (prompt seed + k for sample k): a group generated
with no weight change in between is the same as `generate` gives. The engine labels its tokens with
the policy version it holds (vLLM's weight version), so each sample says which version sampled each
of its tokens, and its logprobs are those of that version.

After a load the next call brings the new version: the label changes, and the prefix cache is reset.
`recompute` also preempts the running samples, whose KV cache is then computed again with the new
weights (what the new policy would have seen); without it they go on over the KV of the old weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlkit.engine.samples import Sample, own_limits


@dataclass(frozen=True)
class GroupRequest:
    """One group to generate: `n` samples of `prompt` (a text, or vLLM's prompt dict), request seed `seed`."""

    key: int  # the driver's number of the group
    prompt: Any
    n: int
    seed: int | None
    limits: tuple[tuple[str, int], ...] = ()  # sampling settings of this group's own (max_tokens, min_tokens)


@dataclass
class StreamReport:
    """What one call of `EngineStream.run` gave back."""

    groups: list[tuple[int, list[Sample]]] = field(default_factory=list)  # finished (key, n samples)
    seconds: float = 0.0  # spent stepping (the engine's busy time)
    running: int = 0  # groups still in the engine


class EngineStream:
    """A `RolloutWorker`'s streaming state: its vLLM engine stepped by hand."""

    def __init__(self, llm: Any):
        self.llm, self.engine = llm, llm.llm_engine
        self.version: int | None = None
        self.running: set[str] = set()
        self.held: list[tuple[int, list[Sample]]] = []  # groups done during `generate`, for the next `run`
        self.paused, self.asides = False, 0

    def add(self, groups: list[GroupRequest], sampling: dict[str, Any], lora_request: Any = None) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for g in groups:
            prompt = {"prompt": g.prompt} if isinstance(g.prompt, str) else dict(g.prompt)
            own = own_limits(prompt, sampling["max_tokens"])
            params = SamplingParams(n=g.n, logprobs=0, seed=g.seed, output_kind=RequestOutputKind.FINAL_ONLY,
                                    **{**sampling, **own, **dict(g.limits)})
            self.engine.add_request(str(g.key), prompt, params, lora_request=lora_request)
            self.running.add(str(g.key))

    def hold(self, abort: list[int], pause: bool) -> None:
        """Stop generating groups `abort` (what they sampled is dropped). `pause`, before a weight load:
        an engine core in a process of its own stops stepping (vLLM's pause, keeping its requests); one
        in this process steps only inside `run`."""
        ids = [str(k) for k in abort if str(k) in self.running]
        if ids:
            self.engine.abort_request(ids)
            self.running.difference_update(ids)
        core = self.engine.engine_core
        if pause and hasattr(core, "call_utility") and not self.paused:
            core.call_utility("pause_scheduler", "keep", False)
        self.paused = self.paused or pause

    def relabel(self, version: int, recompute: bool) -> None:
        """The engine holds policy `version` from now on: label its tokens so, drop the prefix cache
        (with `recompute`, the running samples' KV too), and resume a paused engine core."""
        if version != self.version:
            first = self.version is None
            self.engine.set_weight_version(str(version))
            self.version = version
            if not first:
                self.engine.reset_prefix_cache(reset_running_requests=recompute and bool(self.running))
        if self.paused and hasattr(self.engine.engine_core, "call_utility"):
            self.engine.engine_core.call_utility("resume_scheduler")
        self.paused = False

    def generate(self, inputs: list[Any], params: Any, lora_request: Any = None) -> list[Any]:
        """`LLM.generate`'s outputs for `inputs` (`params`: one `SamplingParams` or one per input). With
        streamed groups running they run beside them: those go on, and the ones done meanwhile come
        out of the next `run`."""
        from vllm.sampling_params import RequestOutputKind

        if not self.running:
            return self.llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
        each = params if isinstance(params, list) else [params] * len(inputs)
        self.asides += 1
        ids = [f"aside-{self.asides}-{i}" for i in range(len(inputs))]
        for rid, prompt, param in zip(ids, inputs, each):
            param = param.clone()
            param.output_kind = RequestOutputKind.FINAL_ONLY
            self.engine.add_request(rid, prompt, param, lora_request=lora_request)
        outs: dict[str, Any] = {}
        while len(outs) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in self.running:
                    self.running.discard(out.request_id)
                    self.held.append((int(out.request_id), _samples(out)))
                elif out.finished:
                    outs[out.request_id] = out
        return [outs[i] for i in ids]

    def run(self, budget_s: float) -> StreamReport:
        """Step the engine (at least once) until `budget_s` seconds have passed or nothing runs; the
        groups done."""
        report, t0 = StreamReport(self.held), time.perf_counter()
        self.held = []
        while self.running:
            for out in self.engine.step():
                if out.finished and out.request_id in self.running:
                    self.running.discard(out.request_id)
                    report.groups.append((int(out.request_id), _samples(out)))
            if time.perf_counter() - t0 >= budget_s:
                break
        report.seconds, report.running = time.perf_counter() - t0, len(self.running)
        return report


def _samples(out: Any) -> list[Sample]:
    """A finished group's samples, in sample order, each with the version of each of its tokens."""
    samples = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        token_ids = list(c.token_ids)
        versions = [0] * len(token_ids)
        for span in c.weight_versions or ():
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], token_ids)]
        samples.append(Sample(0, list(out.prompt_token_ids), token_ids, c.text, lps, str(c.finish_reason),
                              versions=versions))
    return samples
