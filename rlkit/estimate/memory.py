"""The memory of each process of a plan, by part, and whether it fits a device.

What is modelled, per learner rank (N learners, ZeRO stage s; Rajbhandari et al. 2020, "ZeRO",
section 3: 2 + 2 + 12 bytes per parameter in mixed precision):
- parameters: bytes(dtype) per parameter (QLoRA: 4-bit linear weights + their constants), / N under
  ZeRO-3; ZeRO-3 also gathers layers on the fly (4 bytes x the largest layer, as DeepSpeed's own
  estimator counts); offload_param keeps them in host memory;
- gradients of the trainable parameters: bytes(dtype) each, / N from ZeRO-2;
- optimizer (AdamW): fp32 master + m + v = 12 bytes per trainable parameter in bf16 / fp16
  (8 in fp32: m + v), / N from ZeRO-1, in host memory with offload_optimizer;
- activations of one micro-batch (tokens = micro_batch_size x sequence length): per layer and
  token, the tensors a decoder block keeps for backward (10 h + 2 kv + 4 i elements with a gated
  MLP; sdpa / flash attention keep no T x T scores); with gradient checkpointing the layer inputs
  plus one layer's recompute;
- logits: one chunk of the scored tokens x vocab (rlkit never forms the [B, T, vocab] logits:
  `learner/logprobs.py` scores 2**26 logits elements at a time), x (bytes(dtype) + 12): the chunk's
  logits, their fp32 copy, the scaled copy and the fp32 gradient;
- GRPO with beta > 0 and full fine-tuning: a frozen reference copy in the model dtype (not sharded);
- distillation (`grpo/memory.py`): the frozen teacher, whole, and with `loss: jsd` its chunk of logits (model dtype
  + the fp32 log-softmax and its exp, no gradient);
- a fixed 1 GiB for the CUDA / CANN context and the allocator's slack.
Per rollout engine (tensor parallel t): the weights / t; the KV cache for its share of the step's
sequences at max_model_len (2 x layers x kv_heads x head_dim x bytes per token, / t); a runtime
peak (vLLM's profile batch and the sampler's logits); the context; on a CPU, a separate engine's
weight syncs: two buckets mapped from the object store and the layer being reloaded (vLLM builds it
afresh beside the live one, and in bf16 its oneDNN-packed copy: twice the largest layer). vLLM itself takes
gpu_memory_utilization of the device and fills it with KV cache: the verdict asks that what the
step needs fits there. Colocated: the learner's peak while the engine sleeps (rollout.sleep frees
its weights and KV cache), and while it generates the learner's resident state plus the engine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkit.accel import DEVICES
from rlkit.errors import UserError
from rlkit.estimate.arch import Arch

GIB = 2**30
CONTEXT = 1.0 * GIB  # CUDA / CANN context and allocator slack per process on an accelerator
CPU_RUNTIME = 0.2 * GIB  # a CPU process beyond its model (DeepSpeed's engine, oneDNN, the allocator): measured
CPU_COLLECTIVES = 0.05 * GIB  # a CPU rank of 2+ (gloo and DeepSpeed's shared-memory allreduce): measured
DS_REDUCE_BUCKET = 5e8  # DeepSpeed's reduce_bucket_size default (elements): ZeRO-1/2/3 allocate it whole
VLLM_BATCHED_TOKENS = 8192  # vLLM's profile batch (max_num_batched_tokens)
VLLM_MAX_SEQS = 256  # vLLM's max_num_seqs: the sampler's logits rows
# A CPU engine (vLLM in the actor's process) holds four copies of the model's tokenizer (the
# frontend's, its input processor's, detokenizer's and engine core's), about 1 KiB per vocabulary
# entry each (its BPE merges): measured, a Gemma 3 tokenizer (262,144 entries, 515k merges) 0.27
# GiB a copy, 1.12 GiB more in the engine than the same model's weights with a 419-entry one
VLLM_CPU_TOKENIZERS = 4
TOKENIZER_BYTES_PER_ENTRY = 1024
LOGITS_CHUNK = 2**26  # logits elements the learner forms at once (rlkit.learner.logprobs.CHUNK_ELEMENTS)
LOGITS_KEEP_BYTES = 2**29  # what its forward may keep for the backward on a CPU (rlkit.learner.head.KEEP_BYTES)
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

@dataclass(frozen=True)
class Hardware:
    spec: str
    nodes: int
    per_node: int
    name: str
    gib: float
    bf16: bool

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @classmethod
    def parse(cls, spec: str) -> Hardware:
        """`8xA100-80G`, `2x8x910B-64G`, `1xH100`, `4xL40S-48G`."""
        m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([A-Za-z0-9]+?)(?:-(\d+(?:\.\d+)?)G(?:B|iB)?)?", spec.strip())
        known = m and next((v for k, v in DEVICES.items() if k.lower() == m[3].lower()), None)
        if not m or (not known and not m[4]):
            raise UserError(f"--hardware: {spec!r}: expected [NODESx]COUNTxNAME[-MEMG], e.g. 8xA100-80G or "
                            f"2x8x910B-64G (known names: {', '.join(DEVICES)}; another name needs -MEMG)")
        size = float(m[4]) if m[4] else known[0]
        return cls(spec, int(m[1] or 1), int(m[2]), m[3], size, known[1] if known else True)


# ------------------------------------------------------------------ the estimate


@dataclass
class Process:
    """One kind of process: its parts (bytes, on the device), host memory, and how many there are."""

    kind: str
    count: int
    parts: dict[str, float]
    host: dict[str, float] = dataclasses.field(default_factory=dict)
    budget: float | None = None  # a share of the device it may use (vLLM's gpu_memory_utilization)
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryModel:
    """A stage's plan as processes (its package defines one; its row in `rlkit.stages` names it):
    `processes(cfg, arch, hardware)` (hardware None: on a CPU) built from `learner_process`,
    `engine_process` and `colocated`; the devices it takes; `changes`, each `(cfg, hardware) ->
    (what to write, the changed config)` or None, the stage's own single changes that may make a
    plan fit (`plan.fixes` adds the ones every stage shares); `context`, the key whose tokens
    bound a sequence (the report says image tokens count inside it)."""

    processes: Callable[[Any, Arch, Hardware | None], list[Process]]
    devices: Callable[[Any], int]
    changes: tuple[Callable[[Any, Hardware], tuple[str, Any] | None], ...]
    context: str


def estimate(cfg: Any, memory: MemoryModel, arch: Arch, hardware: Hardware | None = None) -> list[Process]:
    """The processes of the plan (a recipe `cfg` of the stage whose model `memory` is), with
    their memory by part."""
    return memory.processes(cfg, arch, hardware)


def devices_needed(cfg: Any, memory: MemoryModel) -> int:
    return memory.devices(cfg)


def context_bytes(hardware: Hardware | None) -> float:
    """The device context a process holds (none on a CPU: the runtime parts count it there)."""
    return CONTEXT if hardware is not None else 0.0


RESIDENT = ("parameters", "gradients", "optimizer state", "reference copy", "teacher copy", "context")


def colocated(learner: Process, engine: Process, sleep: bool, hardware: Hardware | None) -> Process:
    """A learner rank that hosts its engine: the larger of its peak while training (with the
    engine's memory too unless `sleep` frees it, which it does on an accelerator) and while
    generating (what the learner keeps resident, plus the engine)."""
    resident = {k: v for k, v in learner.parts.items() if k in RESIDENT}
    training = dict(learner.parts)
    generating = {**{f"learner {k}": v for k, v in resident.items()},
                  **{f"engine {k}": v for k, v in engine.parts.items() if k != "context"}}
    if not sleep or hardware is None:  # the engine keeps its memory while the learner trains
        training.update({f"engine {k}": v for k, v in engine.parts.items() if k != "context"})
    peak = training if sum(training.values()) >= sum(generating.values()) else generating
    when = "training" if peak is training else "generating"
    return Process("colocated learner + engine", learner.count, peak, learner.host,
                   note=f"peak while {when}; the other phase: "
                        f"{gib(sum((generating if peak is training else training).values()))}")


def width_bytes(dtype: str, hardware: Hardware | None) -> int:
    if dtype == "auto":
        return 2 if hardware is not None and hardware.bf16 else 4
    return BYTES[dtype]


def model_states(params: float, trainable: float, width: int, n: int, zero: int, offload_optimizer: bool = False,
                 offload_param: bool = False, flat_bf16: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per rank of the parameters (`params`: their bytes), gradients and AdamW state of
    `trainable` parameters, on the device and in host memory. Mixed precision (width 2): half
    gradients, fp32 master + m + v (ZeRO paper, K = 12), and at the optimizer step an fp32 copy
    of the gradient partition (as DeepSpeed's own estimators count: 2 + 16 bytes); fp32: the
    gradients, m + v, and under ZeRO the master copy and the step's gradient copy too.
    `flat_bf16` (DeepSpeed's BF16_Optimizer, `DeepSpeedConfig.flat_bf16`): the fp32 gradients are
    an accumulation buffer held throughout (whole), the master + m + v a stage-1 partition."""
    if flat_bf16:
        device, host = model_states(params, trainable, width, n, 1)
        device["fp32 gradient accumulation"] = trainable * 4
        device["fp32 gradients (optimizer step)"] = 0.0
        return device, host
    device, host = {}, {}
    device["parameters"] = params / (n if zero == 3 else 1)
    if zero == 3 and offload_param:
        host["parameters"], device["parameters"] = device["parameters"], 0.0
    device["gradients"] = trainable * width / (n if zero >= 2 else 1)
    # AdamW's m + v, and the fp32 master copy ZeRO keeps (in fp32 too: its optimizer owns a flat copy)
    master = width == 2 or zero >= 1
    device["optimizer state"] = trainable * (12 if master else 8) / (n if zero >= 1 else 1)
    device["fp32 gradients (optimizer step)"] = trainable * 4 / (n if zero >= 1 else 1) if master else 0.0
    if offload_optimizer and zero >= 1:  # DeepSpeed's CPU Adam: the fp32 state and gradients live in host memory
        for part in ("optimizer state", "fp32 gradients (optimizer step)"):
            host[part], device[part] = device[part], 0.0
        if zero >= 2:
            host["gradients"], device["gradients"] = device["gradients"], 0.0
    return device, host


def learner_process(cfg: Any, arch: Arch, width: int, n: int, tokens: int, ctx: float, reference: bool,
                    sync_bytes: float = 0.0) -> Process:
    z, ds = cfg.deepspeed.zero_stage, cfg.deepspeed
    total = arch.params
    v, m = arch.vision, cfg.model
    vision_trained = 0 if v is None else (0 if m.freeze_vision_tower else v.tower) + (
        0 if m.freeze_multi_modal_projector else v.projector)  # a VLM's vision side: what the recipe trains
    if cfg.finetuning == "full":
        trainable, params = arch.language_params + vision_trained, total * width
    else:
        trainable = arch.lora_params(cfg.lora.r, tuple(cfg.lora.target_modules)) + vision_trained
        linear = arch.layers * sum(i * o for i, o in arch.linears().values())
        if cfg.finetuning == "qlora":  # 4-bit weights, an fp32 absmax per 64 (double quant: 8-bit, fp32 per 256)
            per = 0.5 + (1 / 64 + 4 / (64 * 256) if cfg.qlora.double_quant else 4 / 64)
            params = linear * per + (total - linear) * width + trainable * width
        else:
            params = (total + trainable) * width
    flat = width == 2 and cfg.model.dtype != "fp16" and ds.flat_bf16("bf16")  # BF16_Optimizer
    device, host = model_states(params, trainable, width, n, z, ds.offload_optimizer, ds.offload_param, flat)
    step = device.pop("fp32 gradients (optimizer step)")
    parts = dict(device)
    if z == 3:
        parts["ZeRO-3 gathered module"] = 4 * arch.largest_module_params
    act_width = BYTES[cfg.qlora.compute_dtype] if cfg.finetuning == "qlora" else width
    layers = arch.layers * arch.hidden + arch.activation_elements() if cfg.model.gradient_checkpointing else \
        arch.layers * arch.activation_elements()
    backward = {"activations": tokens * act_width * layers,
                "logits": min(tokens * arch.vocab, LOGITS_CHUNK) * (act_width + 12)}
    kept = tokens * arch.vocab * (act_width if act_width == 2 else 4)  # what the forward keeps for the backward
    # beside a chunk being worked on; an accelerator keeps them only within a quarter of what is
    # free when the head runs (rlkit.learner.head.keep_budget): they never decide whether a step fits
    if not ctx and tokens * arch.vocab > LOGITS_CHUNK and kept <= LOGITS_KEEP_BYTES:
        backward["logits kept for backward"] = kept
    if step > sum(backward.values()):  # the peak is the optimizer step, not the backward pass
        parts["fp32 gradients (optimizer step)"] = step
    else:
        parts.update(backward)
    if reference:
        parts["reference copy"] = total * width
    # DeepSpeed's reduce bucket (contiguous gradients); ZeRO-3 allocates it on the device whatever
    # the model's size (measured on an H100: 954 MiB in bf16 at the default size)
    if z in (1, 2, 3) and not (ds.offload_optimizer and z == 2) and not flat:
        bucket = float((ds.extra.get("zero_optimization") or {}).get("reduce_bucket_size", DS_REDUCE_BUCKET))
        parts["DeepSpeed reduce bucket"] = (bucket if ctx else min(bucket, trainable)) * (4 if z == 1 else width)
    if sync_bytes and not ctx:  # object-store sync from the learner's host memory: a copy, and its copy in the store
        parts["weight sync buffers"] = 2 * min(sync_bytes, total * width)
    parts["context" if ctx else "runtime (CPU: DeepSpeed, oneDNN)"] = ctx or CPU_RUNTIME
    if n > 1 and not ctx:
        parts["collectives (CPU, 2+ ranks)"] = CPU_COLLECTIVES
    return Process("learner rank", n, parts, host)


def engine_process(arch: Arch, width: int, r: Any, seqs: int, ctx: float) -> Process:
    t = r.tensor_parallel_size
    kv = seqs * r.max_model_len * arch.kv_bytes_per_token(width) / t
    if not ctx:  # a CPU engine allocates rollout.kv_cache_gib (whole GiB, at least 1: VLLM_CPU_KVCACHE_SPACE)
        kv = max(kv, max(1, round(r.kv_cache_gib)) * GIB)
    runtime = (VLLM_BATCHED_TOKENS * (4 * arch.hidden + 2 * arch.intermediate) * width / t
               + min(seqs, VLLM_MAX_SEQS) * arch.vocab * 4)
    weights = arch.params * width / t
    parts = {"weights": weights, "KV cache for the step" if ctx else "KV cache (preallocated)": kv,
             "runtime peak": runtime}
    if not ctx and width == 2:  # vLLM's CPU bf16 linears keep a oneDNN-packed copy of their weights
        parts["packed weights (CPU bf16)"] = weights
    if not ctx and not r.colocate:  # a sync's bucket from the object store and the copy it is read into
        parts["weight sync buffers"] = 2 * min(r.sync_bucket_mib * 2**20, weights)
        # vLLM reloads a layer by building it afresh beside the live one (materialise, load,
        # process_weights_after_loading, copy back); in bf16 the processing packs a second copy
        parts["weight reload (largest layer)"] = (2 if width == 2 else 1) * arch.largest_module_params * width / t
    if not ctx:  # on an accelerator the tokenizers are host memory, not the device's
        parts["tokenizers (CPU)"] = VLLM_CPU_TOKENIZERS * arch.vocab * TOKENIZER_BYTES_PER_ENTRY
    parts["context" if ctx else "runtime (CPU)"] = ctx or CPU_RUNTIME
    return Process("rollout engine", r.num_engines, parts, budget=r.gpu_memory_utilization,
                   note=f"{seqs} sequences x max_model_len {r.max_model_len}")


def verdicts(processes: list[Process], hardware: Hardware) -> list[tuple[Process, bool, float]]:
    """(process, fits, headroom in bytes) against one device of `hardware`."""
    device = hardware.gib * GIB
    out = []
    for p in processes:
        limit = device * p.budget if p.budget else device
        out.append((p, p.total <= limit, limit - p.total))
    return out


def gib(n: float) -> str:
    """Bytes as the report shows them: GiB, MiB under a tenth of one."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"
