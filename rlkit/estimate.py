"""Memory before launch: what each process of a recipe holds, from the model's config.json only.

    rlkit estimate RECIPE [--hardware 8xA100-80G | 2x8x910B-64G | ...] [key.sub=value ...]

No weights are loaded: a 32B model is estimated on a laptop. Per process kind (a learner rank, a
rollout engine, a colocated learner + engine), the memory by part, then a verdict for one device
of the hardware given, and the changes that make a plan that does not fit fit.

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
- logits: tokens x vocab x (bytes(dtype) + 12): the model's logits, their fp32 copy, the scaled
  copy and the fp32 gradient (rlkit's logprob path today);
- GRPO with beta > 0 and full fine-tuning: a frozen reference copy in the model dtype (not sharded);
- a fixed 1 GiB for the CUDA / CANN context and the allocator's slack.
Per rollout engine (tensor parallel t): the weights / t; the KV cache for its share of the step's
sequences at max_model_len (2 x layers x kv_heads x head_dim x bytes per token, / t); a runtime
peak (vLLM's profile batch and the sampler's logits); the context. vLLM itself takes
gpu_memory_utilization of the device and fills it with KV cache: the verdict asks that what the
step needs fits there. Colocated: the learner's peak while the engine sleeps (rollout.sleep frees
its weights and KV cache), and while it generates the learner's resident state plus the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import UserError

GIB = 2**30
CONTEXT = 1.0 * GIB  # CUDA / CANN context and allocator slack per process on an accelerator
CPU_RUNTIME = 0.2 * GIB  # a CPU process beyond its model (DeepSpeed's engine, oneDNN, the allocator): measured
CPU_COLLECTIVES = 0.05 * GIB  # a CPU rank of 2+ (gloo and DeepSpeed's shared-memory allreduce): measured
DS_REDUCE_BUCKET = 5e8  # DeepSpeed's reduce_bucket_size default (elements): ZeRO-1/2 allocate it whole
VLLM_BATCHED_TOKENS = 8192  # vLLM's profile batch (max_num_batched_tokens)
VLLM_MAX_SEQS = 256  # vLLM's max_num_seqs: the sampler's logits rows
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GATED = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral",
         "deepseek_v2", "deepseek_v3", "phi3", "internlm2", "baichuan", "yi", "olmo2", "granite"}

# Devices by name: memory (GiB), bf16, the kind (the Ray resource). A size in the spec wins.
DEVICES = {"A100": (80, True, "GPU"), "H100": (80, True, "GPU"), "H200": (141, True, "GPU"), "H20": (96, True, "GPU"),
           "A800": (80, True, "GPU"), "H800": (80, True, "GPU"), "L40S": (48, True, "GPU"), "A10": (24, True, "GPU"),
           "4090": (24, True, "GPU"), "3090": (24, True, "GPU"), "V100": (32, False, "GPU"), "T4": (16, False, "GPU"),
           "MI300X": (192, True, "GPU"), "MI250": (64, True, "GPU"), "K100": (64, True, "GPU"),
           "910B": (64, True, "NPU"), "910C": (64, True, "NPU")}

# config.json of the hub models the shipped recipes name (from their published config.json), for
# a host without a hub: the fields the estimate reads.
PUBLISHED = {
    "Qwen/Qwen2.5-32B-Instruct": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648,
                                      num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                      vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                       vocab_size=151936, tie_word_embeddings=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                                      num_hidden_layers=28, num_attention_heads=12,
                                                      num_key_value_heads=2, vocab_size=151936,
                                                      tie_word_embeddings=False),
    "meta-llama/Llama-2-7b-hf": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                     vocab_size=32000, tie_word_embeddings=False),
    "facebook/opt-6.7b": dict(model_type="opt", hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                              num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048,
                              tie_word_embeddings=True, enable_bias=True),
}


# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Arch:
    """What memory depends on in a decoder-only model's config.json."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    gated: bool  # SwiGLU MLP (gate, up, down) rather than fc1, fc2
    bias: bool  # q/k/v (Qwen2) or every linear layer (OPT) has a bias
    positions: int = 0  # learned position embeddings (OPT, GPT-2)
    experts: int = 1  # MoE: MLPs per layer

    @classmethod
    def from_config(cls, c: dict[str, Any], name: str) -> Arch:
        def first(*keys: str, default: Any = None) -> Any:
            return next((c[k] for k in keys if c.get(k) is not None), default)

        hidden = first("hidden_size", "n_embd", "d_model")
        layers = first("num_hidden_layers", "n_layer", "num_layers")
        heads = first("num_attention_heads", "n_head")
        if not (hidden and layers and heads and c.get("vocab_size")):
            raise UserError(f"{name}: config.json has no hidden_size / num_hidden_layers / num_attention_heads / "
                            "vocab_size: rlkit estimate reads decoder-only models")
        kind = c.get("model_type", "")
        return cls(name=name, layers=layers, hidden=hidden, heads=heads,
                   intermediate=first("moe_intermediate_size", "intermediate_size", "ffn_dim", "n_inner",
                                      default=4 * hidden),
                   kv_heads=first("num_key_value_heads", default=heads), head_dim=first("head_dim",
                                                                                       default=hidden // heads),
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", kind != "llama")),
                   gated=kind in GATED, bias=kind in ("qwen2", "opt") or bool(c.get("enable_bias")),
                   positions=c.get("max_position_embeddings", 0) + 2 if kind == "opt" else 0,
                   experts=first("num_experts", "num_local_experts", "n_routed_experts", default=1))

    def linears(self) -> dict[str, tuple[int, int]]:
        """The linear layers of one block, (in, out) features, by the module names LoRA targets."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden)}
        if self.gated:
            return {**attn, "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                    "down_proj": (self.intermediate, self.hidden)}
        return {**attn, "fc1": (self.hidden, self.intermediate), "fc2": (self.intermediate, self.hidden)}

    def layer_params(self) -> int:
        mlp = {"gate_proj", "up_proj", "down_proj", "fc1", "fc2"}
        total = sum(i * o * (self.experts if name in mlp else 1) for name, (i, o) in self.linears().items())
        if self.bias:  # OPT: every linear layer; Qwen2: q, k, v
            total += sum(o for name, (_, o) in self.linears().items()
                         if self.positions or name in ("q_proj", "k_proj", "v_proj"))
        if self.experts > 1:
            total += self.hidden * self.experts  # the router
        return total + 2 * self.hidden * (2 if self.positions else 1)  # norms (OPT's LayerNorm has a bias)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params + self.hidden

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        shapes = self.linears()
        if "all-linear" in targets:
            targets = tuple(shapes)
        return self.layers * sum(r * (i + o) for name, (i, o) in shapes.items() if name in targets)

    @property
    def largest_module_params(self) -> int:
        """The parameters of the largest single module (ZeRO-3 gathers a module at a time): the
        embedding (or lm_head) in a language model, else the widest MLP projection."""
        return max(self.vocab * self.hidden, *(i * o for i, o in self.linears().values()))

    def kv_bytes_per_token(self, width: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * width

    def activation_elements(self) -> int:
        """Elements one block keeps per token for backward (sdpa / flash attention)."""
        mlp = 4 * self.intermediate if self.gated else 2 * self.intermediate
        return 10 * self.hidden + 2 * self.kv_heads * self.head_dim + mlp


def model_config(path: str, config: str | None = None) -> tuple[dict[str, Any], str]:
    """config.json of `path` (a folder or a hub id), or of `config` (a config.json, a folder, a
    hub id, a tiny size: the model a placeholder path stands for), and where it came from."""
    if config:
        if Path(config).is_file():
            return _read_json(Path(config)), config
        return model_config(config)
    local = Path(path) / "config.json"
    if local.is_file():
        return _read_json(local), str(local)
    tiny = _tiny_config(path)
    if tiny:
        return tiny
    if path in PUBLISHED:
        return dict(PUBLISHED[path]), "its published config.json, kept in rlkit"
    try:
        from huggingface_hub import hf_hub_download

        return _read_json(Path(hf_hub_download(path, "config.json"))), "config.json from the hub"
    except Exception as e:  # noqa: BLE001 - offline, missing, gated: one line
        raise UserError(f"model.path: {path} has no config.json here and the hub did not give one "
                        f"({type(e).__name__}): pass --config with the model's config.json, its folder or its hub "
                        "id (for a run's output, the model it started from)") from None


def _tiny_config(path: str) -> tuple[dict[str, Any], str] | None:
    from rlkit.tiny import SIZES

    name = Path(path).name
    for size, s in SIZES.items():
        if name in (size, f"tiny-{size}") or path == size:
            return dict(model_type="qwen2", hidden_size=s.hidden, intermediate_size=s.intermediate,
                        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                        vocab_size=s.vocab, tie_word_embeddings=s.tie_embeddings), f"rlkit's {size} model's config"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it as JSON ({e})") from None


# ------------------------------------------------------------------ the hardware


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
        gib = float(m[4]) if m[4] else known[0]
        return cls(spec, int(m[1] or 1), int(m[2]), m[3], gib, known[1] if known else True)


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


def estimate(cfg: Any, stage: str, arch: Arch, hardware: Hardware | None = None) -> list[Process]:
    """The processes of the plan, with their memory by part."""
    width = _width(cfg.model.dtype, hardware)
    ctx = CONTEXT if hardware is not None else 0.0
    if stage == "sft":
        t = cfg.train
        learner = _learner(cfg, arch, width, t.num_learners, t.micro_batch_size * cfg.data.cutoff_len, ctx,
                           reference=False)
        return [learner]
    g, r = cfg.grpo, cfg.rollout
    seq = r.max_model_len
    learner = _learner(cfg, arch, width, g.num_learners, g.micro_batch_size * seq, ctx,
                       reference=g.beta > 0 and cfg.finetuning == "full",
                       sync_bytes=0.0 if r.colocate else r.sync_bucket_mib * 2**20)
    engines = 1 if r.colocate else r.num_engines
    seqs = math.ceil(g.prompts_per_step * g.group_size / (g.num_learners if r.colocate else engines))
    engine = _engine(arch, width, r, seqs, ctx)
    if not r.colocate:
        return [learner, engine]
    resident = {k: v for k, v in learner.parts.items() if k in ("parameters", "gradients", "optimizer state",
                                                                 "reference copy", "context")}
    training = dict(learner.parts)
    generating = {**{f"learner {k}": v for k, v in resident.items()},
                  **{f"engine {k}": v for k, v in engine.parts.items() if k != "context"}}
    if not r.sleep or hardware is None:  # the engine keeps its memory while the learner trains
        training.update({f"engine {k}": v for k, v in engine.parts.items() if k != "context"})
    peak = training if sum(training.values()) >= sum(generating.values()) else generating
    when = "training" if peak is training else "generating"
    return [Process("colocated learner + engine", g.num_learners, peak, learner.host,
                    note=f"peak while {when}; the other phase: "
                         f"{_gib(sum((generating if peak is training else training).values()))}")]


def _width(dtype: str, hardware: Hardware | None) -> int:
    if dtype == "auto":
        return 2 if hardware is not None and hardware.bf16 else 4
    return BYTES[dtype]


def model_states(params: float, trainable: float, width: int, n: int, zero: int, offload_optimizer: bool = False,
                 offload_param: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per rank of the parameters (`params`: their bytes), gradients and AdamW state of
    `trainable` parameters, on the device and in host memory. Mixed precision (width 2): half
    gradients, fp32 master + m + v (ZeRO paper, K = 12), and at the optimizer step an fp32 copy
    of the gradient partition (as DeepSpeed's own estimators count: 2 + 16 bytes); fp32: the
    gradients, m + v, and under ZeRO the master copy and the step's gradient copy too."""
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


def _learner(cfg: Any, arch: Arch, width: int, n: int, tokens: int, ctx: float, reference: bool,
             sync_bytes: float = 0.0) -> Process:
    z, ds = cfg.deepspeed.zero_stage, cfg.deepspeed
    total = arch.params
    if cfg.finetuning == "full":
        trainable, params = total, total * width
    else:
        trainable = arch.lora_params(cfg.lora.r, tuple(cfg.lora.target_modules))
        linear = arch.layers * sum(i * o for i, o in arch.linears().values())
        if cfg.finetuning == "qlora":  # 4-bit weights, an fp32 absmax per 64 (double quant: 8-bit, fp32 per 256)
            per = 0.5 + (1 / 64 + 4 / (64 * 256) if cfg.qlora.double_quant else 4 / 64)
            params = linear * per + (total - linear) * width + trainable * width
        else:
            params = (total + trainable) * width
    device, host = model_states(params, trainable, width, n, z, ds.offload_optimizer, ds.offload_param)
    step = device.pop("fp32 gradients (optimizer step)")
    parts = dict(device)
    if z == 3:
        parts["ZeRO-3 gathered module"] = 4 * arch.largest_module_params
    act_width = BYTES[cfg.qlora.compute_dtype] if cfg.finetuning == "qlora" else width
    layers = arch.layers * arch.hidden + arch.activation_elements() if cfg.model.gradient_checkpointing else \
        arch.layers * arch.activation_elements()
    backward = {"activations": tokens * act_width * layers, "logits": tokens * arch.vocab * (act_width + 12)}
    if step > sum(backward.values()):  # the peak is the optimizer step, not the backward pass
        parts["fp32 gradients (optimizer step)"] = step
    else:
        parts.update(backward)
    if reference:
        parts["reference copy"] = total * width
    if z in (1, 2) and not (ds.offload_optimizer and z == 2):  # DeepSpeed's reduce bucket (contiguous gradients)
        bucket = float((ds.extra.get("zero_optimization") or {}).get("reduce_bucket_size", DS_REDUCE_BUCKET))
        parts["DeepSpeed reduce bucket"] = (bucket if ctx else min(bucket, trainable)) * (4 if z == 1 else width)
    if sync_bytes and not ctx:  # object-store sync from the learner's host memory: a copy, and its copy in the store
        parts["weight sync buffers"] = 2 * min(sync_bytes, total * width)
    parts["context" if ctx else "runtime (CPU: DeepSpeed, oneDNN)"] = ctx or CPU_RUNTIME
    if n > 1 and not ctx:
        parts["collectives (CPU, 2+ ranks)"] = CPU_COLLECTIVES
    return Process("learner rank", n, parts, host)


def _engine(arch: Arch, width: int, r: Any, seqs: int, ctx: float) -> Process:
    t = r.tensor_parallel_size
    kv = seqs * r.max_model_len * arch.kv_bytes_per_token(width) / t
    if not ctx:  # a CPU engine allocates rollout.kv_cache_gib (whole GiB, at least 1: VLLM_CPU_KVCACHE_SPACE)
        kv = max(kv, max(1, round(r.kv_cache_gib)) * GIB)
    runtime = (VLLM_BATCHED_TOKENS * (4 * arch.hidden + 2 * arch.intermediate) * width / t
               + min(seqs, VLLM_MAX_SEQS) * arch.vocab * 4)
    parts = {"weights": arch.params * width / t, "KV cache for the step" if ctx else "KV cache (preallocated)": kv,
             "runtime peak": runtime, "context" if ctx else "runtime (CPU)": ctx or CPU_RUNTIME}
    return Process("rollout engine", r.num_engines, parts, budget=r.gpu_memory_utilization,
                   note=f"{seqs} sequences x max_model_len {r.max_model_len}")


# ------------------------------------------------------------------ the verdict and the fixes


def devices_needed(cfg: Any, stage: str) -> int:
    if stage == "sft":
        return cfg.train.num_learners
    r = cfg.rollout
    return cfg.grpo.num_learners + (0 if r.colocate else r.num_engines * r.tensor_parallel_size)


def verdicts(processes: list[Process], hardware: Hardware) -> list[tuple[Process, bool, float]]:
    """(process, fits, headroom in bytes) against one device of `hardware`."""
    device = hardware.gib * GIB
    out = []
    for p in processes:
        limit = device * p.budget if p.budget else device
        out.append((p, p.total <= limit, limit - p.total))
    return out


FIXES = (  # (what to write, how it changes the config)
    ("deepspeed.zero_stage=3", lambda c: _set(c, "deepspeed", zero_stage=3)),
    ("deepspeed.offload_optimizer=true", lambda c: _set(c, "deepspeed", offload_optimizer=True,
                                                        zero_stage=max(c.deepspeed.zero_stage, 2))),
    ("model.gradient_checkpointing=true", lambda c: _set(c, "model", gradient_checkpointing=True)),
    ("half the micro-batch, twice the accumulation", lambda c: _half_micro_batch(c)),
    ("rollout.tensor_parallel_size x2", lambda c: _set(c, "rollout", tensor_parallel_size=2 *
                                                       c.rollout.tensor_parallel_size) if hasattr(c, "rollout")
     else None),
    ("rollout.colocate=false", lambda c: _set(c, "rollout", colocate=False)
     if hasattr(c, "rollout") and c.rollout.colocate else None),
    ("rollout.colocate=true", lambda c: _set(c, "rollout", colocate=True, num_engines=c.grpo.num_learners,
                                             tensor_parallel_size=1)
     if hasattr(c, "rollout") and not c.rollout.colocate else None),
)


def fixes(cfg: Any, stage: str, arch: Arch, hardware: Hardware) -> list[tuple[str, float, bool]]:
    """Each single change that lowers the largest process's peak (or the devices taken, when the
    hardware has too few): (change, its new peak, whether the plan then fits)."""
    before = max(p.total for p in estimate(cfg, stage, arch, hardware))
    out = []
    for label, change in (*FIXES, ("the devices there are", lambda c: _fit_devices(c, stage, hardware))):
        try:
            changed = change(cfg)
        except (TypeError, ValueError, AttributeError, UserError):  # a change this recipe cannot take
            changed = None
        if changed is None or changed == cfg:
            continue
        processes = estimate(changed, stage, arch, hardware)
        peak = max(p.total for p in processes)
        fewer = devices_needed(changed, stage) < devices_needed(cfg, stage) > hardware.devices
        if peak < before * 0.98 or fewer:
            fits = all(ok for _, ok, _ in verdicts(processes, hardware))
            fits &= devices_needed(changed, stage) <= hardware.devices
            if label.startswith("half") and stage == "sft":
                label = (f"train.micro_batch_size={changed.train.micro_batch_size} "
                         f"train.grad_accum={changed.train.grad_accum}")
            elif label.startswith("half"):
                label = f"grpo.micro_batch_size={changed.grpo.micro_batch_size}"
            elif label == "the devices there are" and stage == "sft":
                label = f"train.num_learners={changed.train.num_learners}"
            elif label == "the devices there are":
                label = (f"grpo.num_learners={changed.grpo.num_learners} rollout.colocate=true" if
                         changed.rollout.colocate else f"grpo.num_learners={changed.grpo.num_learners} "
                         f"rollout.num_engines={changed.rollout.num_engines}")
            elif label.startswith("rollout.tensor"):
                label = f"rollout.tensor_parallel_size={changed.rollout.tensor_parallel_size}"
            out.append((label, peak, fits))
    return out


def _set(cfg: Any, section: str, **values: Any) -> Any:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def _fit_devices(cfg: Any, stage: str, hardware: Hardware) -> Any:
    """The plan on the devices the hardware has (fewer learners; GRPO on one device: colocated)."""
    have = hardware.devices
    if devices_needed(cfg, stage) <= have:
        return None
    if stage == "sft":
        return _set(cfg, "train", num_learners=have)
    r = cfg.rollout
    if r.colocate or have < 2:
        return _set(_set(cfg, "grpo", num_learners=have), "rollout", colocate=True, num_engines=have)
    engines = max(1, min(r.num_engines, (have // 2) // r.tensor_parallel_size))
    return _set(_set(cfg, "grpo", num_learners=have - engines * r.tensor_parallel_size), "rollout",
                num_engines=engines)


def _half_micro_batch(cfg: Any) -> Any:
    if hasattr(cfg, "train"):
        t = cfg.train
        if t.micro_batch_size < 2:
            return None
        return _set(cfg, "train", micro_batch_size=t.micro_batch_size // 2, grad_accum=t.grad_accum * 2)
    g = cfg.grpo
    return None if g.micro_batch_size < 2 else _set(cfg, "grpo", micro_batch_size=g.micro_batch_size // 2)


# ------------------------------------------------------------------ the command


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="memory per process of a recipe, before launch (reads config.json only)",
                       description="memory per process of a recipe by part, a verdict per device of the hardware, "
                                   "and the changes that make it fit")
    p.add_argument("recipe", help="an sft or grpo recipe")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override recipe keys")
    p.add_argument("--hardware", default=None, help="e.g. 8xA100-80G, 2x8x910B-64G, 1xH100 (default: no verdict)")
    p.add_argument("--config", default=None, help="the model's config.json, folder or hub id, when model.path has "
                                                  "none here (a placeholder, a run not made yet)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from rlkit import stages

    try:
        declared = (yaml.safe_load(Path(args.recipe).read_text(encoding="utf-8")) or {}).get("stage", "sft")
    except (OSError, yaml.YAMLError, AttributeError):
        declared = "sft"
    stage = declared if declared in stages.STAGES else "sft"
    cfg = stages.load(stage, args.recipe, list(args.overrides))
    config, source = model_config(cfg.model.path, args.config)
    arch = Arch.from_config(config, cfg.model.path)
    hardware = Hardware.parse(args.hardware) if args.hardware else None
    for line in report(cfg, stage, arch, source, hardware):
        print(line)
    return 0


def report(cfg: Any, stage: str, arch: Arch, source: str, hardware: Hardware | None) -> list[str]:
    """The estimate as the console shows it."""
    width = _width(cfg.model.dtype, hardware)
    count = f"{arch.params / 1e9:.2f}B" if arch.params >= 1e9 else f"{arch.params / 1e6:.2f}M"
    lines = [f"{arch.name}: {count} parameters ({source}); {cfg.finetuning} fine-tuning, "
             f"{cfg.model.dtype if cfg.model.dtype != 'auto' else {2: 'bf16', 4: 'fp32'}[width]}, "
             f"ZeRO-{cfg.deepspeed.zero_stage}"]
    processes = estimate(cfg, stage, arch, hardware)
    for p in processes:
        lines.append(f"{p.kind} (x{p.count}){': ' + p.note if p.note else ''}")
        for part, size in p.parts.items():
            if size or part not in p.host:
                lines.append(f"  {part:<34} {_gib(size):>10}")
        lines.append(f"  {'total':<34} {_gib(p.total):>10}")
        if p.host:
            lines.append(f"  offloaded to host memory: {_gib(sum(p.host.values()))} per rank "
                         f"({', '.join(p.host)})")
    if hardware is None:
        return lines
    need = devices_needed(cfg, stage)
    lines.append(f"on {hardware.spec} ({hardware.devices} devices of {hardware.gib:g} GiB):")
    if need > hardware.devices:
        lines.append(f"  the plan takes {need} devices, the hardware has {hardware.devices}")
    all_fit = need <= hardware.devices
    for p, ok, headroom in verdicts(processes, hardware):
        share = f" of the {p.budget:g} x {hardware.gib:g} GiB vLLM takes" if p.budget else f" of {hardware.gib:g} GiB"
        verdict = f"fits, {_gib(headroom)} to spare" if ok else f"does NOT fit: {_gib(-headroom)} over"
        lines.append(f"  {p.kind}: {_gib(p.total)}{share}: {verdict}")
        all_fit &= ok
    if not all_fit:
        options = fixes(cfg, stage, arch, hardware)
        if options:
            lines.append("  changes that lower the peak (each alone):")
            lines += [f"    {label}: peak {_gib(peak)}{' (fits)' if fits else ''}" for label, peak, fits in options]
    return lines


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"


def check_before_launch(cfg: Any, stage: str, device: Any) -> str | None:
    """On an accelerator, the one line that says the plan does not fit its devices (None when it
    fits, on a CPU, or when the model's config.json cannot be read here)."""
    if not device.is_accelerator or cfg.memory_check == "off" or not device.total_memory_bytes:
        return None
    try:
        config, _ = model_config(cfg.model.path)
        arch = Arch.from_config(config, cfg.model.path)
    except UserError:
        return None
    gib = device.total_memory_bytes / GIB
    name = re.sub(r"[^A-Za-z0-9]", "", device.device_name.split()[-1]) or device.kind
    hardware = Hardware(f"{device.device_count}x{name}-{gib:.0f}G", 1, device.device_count, name, gib, device.bf16)
    over = [(p, -room) for p, ok, room in verdicts(estimate(cfg, stage, arch, hardware), hardware) if not ok]
    if not over:
        return None
    p, excess = max(over, key=lambda x: x[1])
    return (f"memory: a {p.kind} needs about {_gib(p.total)}, {_gib(excess)} more than a {gib:.0f} GiB device "
            f"gives it (an estimate: rlkit estimate RECIPE --hardware {hardware.spec} shows the parts and the "
            "changes that fit)")
