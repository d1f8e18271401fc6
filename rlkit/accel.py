"""Device layer: one small description of the accelerator this process runs on.

`describe(probe)` is pure: it maps what torch reports (a `Probe`) to a `DeviceInfo`, so every
backend is testable on any machine. `detect()` takes the probe from the real torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["cuda", "rocm", "npu", "cpu"]


@dataclass(frozen=True)
class Probe:
    """What the runtime reports; fields default to a CPU-only host."""

    cuda_available: bool = False
    hip_version: str | None = None  # torch.version.hip: set on ROCm / Hygon DCU builds
    npu_available: bool = False  # torch_npu imported and torch.npu.is_available()
    device_count: int = 0
    device_name: str = "cpu"
    bf16_supported: bool = False
    free_memory_bytes: int | None = None
    total_memory_bytes: int | None = None


@dataclass(frozen=True)
class DeviceInfo:
    """How rlkit uses a device kind: torch device, collective backend, env and Ray names."""

    kind: Kind
    torch_device: str  # "cuda" (also ROCm), "npu", "cpu"
    dist_backend: str  # torch.distributed backend: nccl (rccl on ROCm), hccl, gloo
    visible_devices_var: str | None  # CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, ...
    ray_resource: str | None  # resource to request per actor: "GPU", "NPU"; None on CPU
    device_count: int
    device_name: str
    bf16: bool
    fp16: bool
    free_memory_bytes: int | None
    total_memory_bytes: int | None
    env: dict[str, str] = field(default_factory=dict)  # recommended environment for workers
    socket_ifname_var: str = "GLOO_SOCKET_IFNAME"  # names the network interface its process group uses
    fused_adamw: bool = False  # torch's fused AdamW kernel runs on it
    triton: bool = False  # Triton kernels run on it (Liger's: `model.kernels: liger`)
    kernels_auto: bool = False  # `model.kernels: auto` applies Liger's kernels on it

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def ray_gpus(self) -> bool:
        """Ray counts this device as its own `num_gpus` (else as the custom resource `ray_resource`)."""
        return self.ray_resource == "GPU"

    @property
    def weight_sync_backend(self) -> str | None:
        """Communicator for learner -> vLLM weight broadcast: vLLM's PyNccl (CUDA, ROCm's RCCL)
        or vllm-ascend's PyHccl; None on CPU (weights go through the Ray object store)."""
        return {"nccl": "nccl", "hccl": "hccl"}.get(self.dist_backend)


# The devices of each kind by name, for the memory estimate's `--hardware` (`rlkit.estimate.memory.Hardware`):
# memory (GiB), bf16, the kind (its Ray resource). A size in the spec wins.
DEVICES = {"A100": (80, True, "GPU"), "H100": (80, True, "GPU"), "H200": (141, True, "GPU"), "H20": (96, True, "GPU"),
           "A800": (80, True, "GPU"), "H800": (80, True, "GPU"), "L40S": (48, True, "GPU"), "A10": (24, True, "GPU"),
           "4090": (24, True, "GPU"), "3090": (24, True, "GPU"), "V100": (32, False, "GPU"), "T4": (16, False, "GPU"),
           "MI300X": (192, True, "GPU"), "MI250": (64, True, "GPU"), "K100": (64, True, "GPU"),
           "910B": (64, True, "NPU"), "910C": (64, True, "NPU")}

# The Ray resources a device kind is asked for by (`DeviceInfo.ray_resource`).
RAY_DEVICE_RESOURCES = ("GPU", "NPU")
# The weight-broadcast communicator of each collective backend ("module:Class"): vLLM's PyNccl (CUDA,
# ROCm's RCCL) or vllm-ascend's PyHccl (Ascend NPU).
COMMUNICATORS = {"nccl": "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator",
                 "hccl": "vllm_ascend.distributed.device_communicators.pyhccl:PyHcclCommunicator"}


def _nccl_ready() -> tuple[bool, str]:
    import torch.distributed as dist

    ok = dist.is_nccl_available()
    return ok, "NCCL " + ("available" if ok else "missing from this torch")


def _gloo_ready() -> tuple[bool | None, str]:
    from pathlib import Path

    from torch.utils import cpp_extension

    built = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False))
    if any(built.glob("*.so")):
        return True, f"gloo; DeepSpeed's shared-memory op is built ({built})"
    return None, "gloo; DeepSpeed's shared-memory op is not built yet: the first run builds it (about 80-100 s, once)"


# What `rlkit doctor` checks of each collective backend: ready (True), not (False) or not yet (None), and
# what it says.
COMM_CHECKS = {"nccl": _nccl_ready, "hccl": lambda: (True, "HCCL (torch_npu)"), "gloo": _gloo_ready}

# Environment advice taken from the seed guides; applied with setdefault (the user wins).
ROCM_ENV = {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:128", "HIP_FORCE_DEV_KERNARG": "1"}
NPU_ENV = {"HCCL_CONNECT_TIMEOUT": "1800"}
# CPU processes also keep the memory they free: glibc's malloc hands freed heap memory back to the
# kernel once more than 64 MiB lie free at its top, so every micro-batch's activations were page
# faults again (two times the faults of a plain torch loop, ~80k a step on the 25M bench model), and
# while an engine generates on the other core those faults made the learner's step 9% slower
# (scripts/bench_grpo.py). Allocations up to 32 MiB (glibc's largest threshold) come from the heap.
CPU_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_MMAP_THRESHOLD_": str(2**25)}
# bf16 matmuls on CPU go through oneDNN, and torch keeps each shape's kernels in two caches (oneDNN's
# primitive cache and ideep's LRU cache), 1024 entries each by default. Sequence lengths change every
# micro-batch, so both fill: SmolLM2-135M's learner grew ~12 MiB a step for ~50 steps (+570 MiB, and
# more for GRPO's many shapes, whose learner grew 2.7 GiB in 60 steps). 256 entries hold a step's shapes
# (a shape takes ~25); a kernel built again costs ~0.3 ms. fp32 matmuls keep no such cache.
CPU_KERNEL_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
CPU_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **CPU_MALLOC_ENV, **CPU_KERNEL_CACHE_ENV}


def describe(probe: Probe) -> DeviceInfo:
    """Map probed facts to a `DeviceInfo`. NPU wins over CUDA, ROCm is CUDA with `hip_version`."""
    common = dict(device_count=probe.device_count, device_name=probe.device_name,
                  free_memory_bytes=probe.free_memory_bytes, total_memory_bytes=probe.total_memory_bytes)
    if probe.npu_available:
        return DeviceInfo("npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU",
                          bf16=probe.bf16_supported, fp16=True, env=dict(NPU_ENV),
                          socket_ifname_var="HCCL_SOCKET_IFNAME", **common)
    gpu = dict(fp16=True, socket_ifname_var="NCCL_SOCKET_IFNAME", fused_adamw=True, triton=True)
    if probe.cuda_available and probe.hip_version:  # Liger on ROCm / DCU when asked for (`liger`), not by `auto`
        return DeviceInfo("rocm", "cuda", "nccl", "HIP_VISIBLE_DEVICES", "GPU",
                          bf16=probe.bf16_supported, env=dict(ROCM_ENV), **gpu, **common)
    if probe.cuda_available:
        return DeviceInfo("cuda", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU",
                          bf16=probe.bf16_supported, env={}, kernels_auto=True, **gpu, **common)
    # CPU: bf16 where oneDNN has native bf16 kernels (AVX512-BF16 / AMX); fp16 is not a training
    # dtype on CPU (DeepSpeed's fp16 loss scaling is for accelerators). torch's fused AdamW: 3x its
    # per-tensor loop here.
    return DeviceInfo("cpu", "cpu", "gloo", None, None, bf16=probe.bf16_supported, fp16=False,
                      env=dict(CPU_ENV), fused_adamw=True, **{**common, "device_count": 0})


def probe_torch() -> Probe:
    """Read the live facts from torch (and torch_npu when it is installed)."""
    import torch

    npu = False
    try:  # torch_npu registers torch.npu on import
        import torch_npu  # noqa: F401

        npu = bool(torch.npu.is_available())
    except ImportError:
        pass
    if npu:
        free, total = torch.npu.mem_get_info()
        return Probe(npu_available=True, device_count=torch.npu.device_count(),
                     device_name=torch.npu.get_device_name(0), bf16_supported=True,
                     free_memory_bytes=free, total_memory_bytes=total)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return Probe(cuda_available=True, hip_version=getattr(torch.version, "hip", None),
                     device_count=torch.cuda.device_count(), device_name=torch.cuda.get_device_name(0),
                     bf16_supported=torch.cuda.is_bf16_supported(),
                     free_memory_bytes=free, total_memory_bytes=total)
    return _cpu_probe()


def _cpu_probe() -> Probe:
    import torch

    return Probe(bf16_supported=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                 free_memory_bytes=_host_available_memory(), total_memory_bytes=_host_total_memory())


def detect(prefer: str = "auto") -> DeviceInfo:
    """The device of this process; `prefer="cpu"` forces CPU even where an accelerator exists."""
    if prefer == "cpu":
        return describe(_cpu_probe())
    info = describe(probe_torch())
    if prefer not in ("auto", info.kind):
        from rlkit.errors import UserError

        raise UserError(f"device: the recipe asks for {prefer!r} but this host has {info.kind!r} "
                        "(set device: auto, or run it where that device is)")
    return info


def of_kind(kind: str) -> DeviceInfo:
    """A `DeviceInfo` for a device kind this process need not have ("cuda", "rocm", "npu", "cpu";
    "auto": this process's own): its torch device and Ray resource, for an actor started on
    another node (one device, bf16 on accelerators, no memory figures)."""
    if kind == "auto":
        return detect()
    if kind not in ("cuda", "rocm", "npu", "cpu"):
        from rlkit.errors import UserError

        raise UserError(f"device: {kind!r} is not a device kind; use auto, cuda, rocm, npu or cpu")
    if kind == "cpu":
        return describe(Probe())
    return describe(Probe(cuda_available=kind != "npu", hip_version="rocm" if kind == "rocm" else None,
                          npu_available=kind == "npu", device_count=1, device_name=kind, bf16_supported=True))


def check_precision(dtype: str, info: DeviceInfo, key: str = "model.dtype") -> None:
    """A training precision this device cannot run is a one-line error before launch."""
    from rlkit.errors import UserError

    if dtype == "fp16" and not info.fp16:
        raise UserError(f"{key}: fp16 does not train on {info.device_name} ({info.kind}: DeepSpeed's fp16 loss "
                        f"scaling runs on GPUs and NPUs): use {'bf16 or ' if info.bf16 else ''}fp32, or auto")
    if dtype == "bf16" and not info.bf16:
        instead = "fp16 or fp32" if info.fp16 else "fp32"
        what = "this CPU has no native bf16 (AVX512-BF16 or AMX)" if info.kind == "cpu" else "it has no bf16"
        raise UserError(f"{key}: bf16 does not run on {info.device_name} ({info.kind}; {what}): use {instead}, "
                        "or auto")


def apply_env(info: DeviceInfo, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the recommended variables where the user has not; returns what was set."""
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in info.env.items() if k not in env}
    env.update(applied)
    return applied


def configure_cpu_threads(threads: int | None = None) -> int:
    """One OpenMP thread per process unless OMP_NUM_THREADS or `threads` says otherwise.

    On two cores, two threads per rank made training steps 10-15x slower.
    """
    import torch

    n = threads or int(os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    return n


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _host_available_memory() -> int | None:
    return _meminfo("MemAvailable")


def _host_total_memory() -> int | None:
    return _meminfo("MemTotal")


def memory_now(info: DeviceInfo | None = None) -> dict[str, int]:
    """This process's memory in bytes: `rss` and its peak `rss_peak` (Linux /proc/self/status),
    and on an accelerator `device_peak` (torch's max_memory_allocated)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "rss_peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if info is not None and info.is_accelerator:
        import torch

        module = getattr(torch, info.torch_device, None)
        if module is not None and hasattr(module, "max_memory_allocated"):
            out["device_peak"] = int(module.max_memory_allocated())
    return out
