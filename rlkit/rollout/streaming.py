"""Streaming generation inside a rollout engine (`grpo.streaming`): groups go in as the driver
assigns them, a group comes out as soon as all its samples are done, and new weights load between
the engine's steps while samples are still running (partial rollouts).

The engine is stepped by hand (vLLM's `LLMEngine.add_request` / `step`), a budget of seconds per
call, so the actor stays free between calls for the driver's next call and the weight sync's loads.
Each group is one request of `n` samples, with the seeds `generate` gives (prompt seed + k for sample
k): a group generated with no weight change in between is the same as `generate` gives. Its tokens
come out step by step (vLLM's `DELTA` outputs) and are kept here until its last sample ends, so the
engine can give back what its groups have sampled so far at any point (`cut`, at a checkpoint).

Each token carries the policy version the engine held when it was sampled: the label set on each call
(vLLM's weight version, whose spans a finished sample's output carries: those are what counts; a
sample cut before its end keeps the label of the call that received each token), and its logprob is
that version's.

A group given back with its samples so far (`GroupRequest.start`) goes on from there: each unfinished
sample is a request of its own whose prompt is the prompt and the tokens so far, its limits less
those tokens, its seed derived from the group's, the sample's and the tokens so far (so a run that
resumes from a checkpoint goes on as the run that wrote it). Its earlier tokens count as prompt for
vLLM: a frequency or presence penalty does not see them. A prompt with images starts over instead.

After a load the next call brings the new version: the label changes, and the prefix cache is reset.
`recompute` also preempts the running samples, whose KV cache is then computed again with the new
weights (what the new policy would have seen); without it they go on over the KV of the old weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlkit.rollout.samples import Sample, own_limits
from rlkit.seeding import derive_seed


@dataclass(frozen=True)
class GroupRequest:
    """One group to generate: `n` samples of `prompt` (a text, or vLLM's prompt dict), request seed `seed`."""

    key: int  # the driver's number of the group
    prompt: Any
    n: int
    seed: int | None
    limits: tuple[tuple[str, int], ...] = ()  # sampling settings of this group's own (max_tokens, min_tokens)
    start: tuple[Sample, ...] = ()  # a group cut before its end (`EngineStream.cut`): its samples so far


@dataclass
class StreamReport:
    """What one call of `EngineStream.run` gave back."""

    groups: list[tuple[int, list[Sample]]] = field(default_factory=list)  # finished (key, n samples)
    seconds: float = 0.0  # spent stepping (the engine's busy time)
    running: int = 0  # groups still in the engine


@dataclass
class _Slot:
    """One sample of a group in the engine, as far as it got."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while it runs
    base: int = 0  # tokens it had when its request went in (a cut sample's)

    def take(self, c: Any, version: int | None) -> None:
        """Append a step's output `c` (vLLM's delta `CompletionOutput`) sampled under `version`."""
        self.token_ids += c.token_ids
        self.text += c.text
        self.logprobs += [float(step[t].logprob) for step, t in zip(c.logprobs or [], c.token_ids)]
        self.versions += [version or 0] * len(c.token_ids)
        if c.finish_reason is not None:
            self.finish_reason = str(c.finish_reason)
            for span in c.weight_versions or ():  # the engine's own labels: they count where given
                at = slice(self.base + span.start, self.base + span.end)
                self.versions[at] = [int(span.version)] * (span.end - span.start)

    def sample(self) -> Sample:
        return Sample(0, list(self.prompt_token_ids), list(self.token_ids), self.text, list(self.logprobs),
                      self.finish_reason, versions=list(self.versions))


class EngineStream:
    """A `RolloutWorker`'s streaming state: its vLLM engine stepped by hand."""

    def __init__(self, llm: Any):
        self.llm, self.engine = llm, llm.llm_engine
        self.version: int | None = None
        self.groups: dict[int, list[_Slot]] = {}  # key -> its samples, as far as they got
        self.requests: dict[str, tuple[int, int]] = {}  # request id -> (key, the first sample it gives)
        self.held: list[tuple[int, list[Sample]]] = []  # groups done during `generate`, for the next `run`
        self.paused, self.asides = False, 0

    def add(self, groups: list[GroupRequest], sampling: dict[str, Any], lora_request: Any = None) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for g in groups:
            prompt = {"prompt": g.prompt} if isinstance(g.prompt, str) else dict(g.prompt)
            settings = {**sampling, **own_limits(prompt, sampling["max_tokens"]), **dict(g.limits)}
            start = [] if "multi_modal_data" in prompt else list(g.start)  # images: started over
            slots = self.groups[g.key] = [_Slot([]) for _ in range(g.n)]
            if not start:
                params = SamplingParams(n=g.n, logprobs=0, seed=g.seed, output_kind=RequestOutputKind.DELTA,
                                        **settings)
                self.engine.add_request(str(g.key), prompt, params, lora_request=lora_request)
                self.requests[str(g.key)] = (g.key, 0)
                continue
            for k, s in enumerate(start):
                slots[k] = _Slot(list(s.prompt_token_ids), list(s.token_ids), s.text, list(s.logprobs),
                                 list(s.versions or [0] * len(s.token_ids)), s.finish_reason, len(s.token_ids))
                if s.finish_reason:
                    continue
                done = len(s.token_ids)
                params = SamplingParams(
                    n=1, logprobs=0, output_kind=RequestOutputKind.DELTA,
                    seed=None if g.seed is None else derive_seed(g.seed, "continued", k, done),
                    **{**settings, "max_tokens": settings["max_tokens"] - done,
                       "min_tokens": max(0, settings.get("min_tokens", 0) - done)})
                rid = f"{g.key}.{k}"
                self.engine.add_request(rid, {"prompt_token_ids": slots[k].prompt_token_ids + s.token_ids}, params,
                                        lora_request=lora_request)
                self.requests[rid] = (g.key, k)
            if all(slot.finish_reason for slot in slots):  # (cut as its last sample ended)
                self.held.append((g.key, [slot.sample() for slot in self.groups.pop(g.key)]))

    def hold(self, abort: list[int], pause: bool) -> None:
        """Stop generating groups `abort` (what they sampled is dropped). `pause`, before a weight load:
        an engine core in a process of its own stops stepping (vLLM's pause, keeping its requests); one
        in this process steps only inside `run`."""
        self._drop(set(abort))
        core = self.engine.engine_core
        if pause and hasattr(core, "call_utility") and not self.paused:
            core.call_utility("pause_scheduler", "keep", False)
        self.paused = self.paused or pause

    def cut(self) -> list[tuple[int, list[Sample]]]:
        """Every group in the engine, stopped, with its samples so far (an unfinished one's
        `finish_reason` is ""): what a checkpoint keeps, given back as `GroupRequest.start`; and the
        groups done and not yet given back (during a `generate`)."""
        groups = self.held + [(key, [slot.sample() for slot in slots]) for key, slots in self.groups.items()]
        self.held = []
        self._drop(set(self.groups))
        return groups

    def _drop(self, keys: set[int]) -> None:
        ids = [rid for rid, (key, _) in self.requests.items() if key in keys]
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            del self.requests[rid]
        for key in keys:
            self.groups.pop(key, None)

    def relabel(self, version: int, recompute: bool) -> None:
        """The engine holds policy `version` from now on: label its tokens so, drop the prefix cache
        (with `recompute`, the running samples' KV too), and resume a paused engine core."""
        if version != self.version:
            first = self.version is None
            self.engine.set_weight_version(str(version))
            self.version = version
            if not first:
                self.engine.reset_prefix_cache(reset_running_requests=recompute and bool(self.groups))
        if self.paused and hasattr(self.engine.engine_core, "call_utility"):
            self.engine.engine_core.call_utility("resume_scheduler")
        self.paused = False

    def _take(self, out: Any) -> tuple[int, list[Sample]] | None:
        """A streamed request's step output into its group's samples; the group, once all are done."""
        key, first = self.requests[out.request_id]
        slots = self.groups[key]
        for c in out.outputs:
            slot = slots[first + c.index]
            slot.prompt_token_ids = slot.prompt_token_ids or list(out.prompt_token_ids)
            slot.take(c, self.version)
        if out.finished:
            del self.requests[out.request_id]
        if all(slot.finish_reason for slot in slots):
            del self.groups[key]
            return key, [slot.sample() for slot in slots]
        return None

    def generate(self, inputs: list[Any], params: Any, lora_request: Any = None) -> list[Any]:
        """`LLM.generate`'s outputs for `inputs` (`params`: one `SamplingParams` or one per input). With
        streamed groups running they run beside them: those go on, and the ones done meanwhile come
        out of the next `run`."""
        from vllm.sampling_params import RequestOutputKind

        if not self.groups:
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
                if out.request_id in self.requests:
                    self.held += filter(None, [self._take(out)])
                elif out.finished:
                    outs[out.request_id] = out
        return [outs[i] for i in ids]

    def run(self, budget_s: float) -> StreamReport:
        """Step the engine (at least once) until `budget_s` seconds have passed or nothing runs; the
        groups done."""
        report, t0 = StreamReport(self.held), time.perf_counter()
        self.held = []
        while self.groups:
            for out in self.engine.step():
                if out.request_id in self.requests:
                    report.groups += filter(None, [self._take(out)])
            if time.perf_counter() - t0 >= budget_s:
                break
        report.seconds, report.running = time.perf_counter() - t0, len(self.groups)
        return report
