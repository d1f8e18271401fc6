"""Every backend's description, from the facts the detector probes (no global torch patching)."""

import pytest

from rlkit.accel import Probe, apply_env, configure_cpu_threads, describe, detect

GiB = 1 << 30


def test_cpu_description():
    info = describe(Probe(bf16_supported=True, free_memory_bytes=20 * GiB, total_memory_bytes=24 * GiB))
    assert (info.kind, info.torch_device, info.dist_backend) == ("cpu", "cpu", "gloo")
    assert info.visible_devices_var is None and info.ray_resource is None
    assert info.bf16 and not info.fp16 and not info.is_accelerator
    assert info.env["OMP_NUM_THREADS"] == "1"
    assert info.free_memory_bytes == 20 * GiB


def test_cuda_description():
    info = describe(Probe(cuda_available=True, device_count=8, device_name="NVIDIA H100",
                          bf16_supported=True, free_memory_bytes=70 * GiB, total_memory_bytes=80 * GiB))
    assert (info.kind, info.torch_device, info.dist_backend) == ("cuda", "cuda", "nccl")
    assert info.visible_devices_var == "CUDA_VISIBLE_DEVICES" and info.ray_resource == "GPU"
    assert info.bf16 and info.fp16 and info.device_count == 8 and info.env == {}


def test_rocm_dcu_description():
    # Hygon DCU / AMD: torch.cuda is available and torch.version.hip is set; RCCL behind "nccl".
    info = describe(Probe(cuda_available=True, hip_version="6.2.41134", device_count=4,
                          device_name="K100_AI", bf16_supported=True))
    assert (info.kind, info.torch_device, info.dist_backend) == ("rocm", "cuda", "nccl")
    assert info.visible_devices_var == "HIP_VISIBLE_DEVICES" and info.ray_resource == "GPU"
    assert info.env == {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:128", "HIP_FORCE_DEV_KERNARG": "1"}


def test_ascend_npu_description():
    info = describe(Probe(npu_available=True, device_count=8, device_name="Ascend910B", bf16_supported=True))
    assert (info.kind, info.torch_device, info.dist_backend) == ("npu", "npu", "hccl")
    assert info.visible_devices_var == "ASCEND_RT_VISIBLE_DEVICES" and info.ray_resource == "NPU"
    assert info.env == {"HCCL_CONNECT_TIMEOUT": "1800"}


def test_old_cuda_without_bf16():
    info = describe(Probe(cuda_available=True, device_count=1, bf16_supported=False))
    assert not info.bf16 and info.fp16


def test_apply_env_keeps_user_values():
    info = describe(Probe(cuda_available=True, hip_version="6.0", device_count=1))
    env = {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:64"}
    applied = apply_env(info, env)
    assert applied == {"HIP_FORCE_DEV_KERNARG": "1"}
    assert env["PYTORCH_HIP_ALLOC_CONF"] == "max_split_size_mb:64"


def test_detect_on_this_host_is_cpu_with_one_thread(monkeypatch):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("host has an accelerator")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    info = detect()
    assert info.kind == "cpu" and info.free_memory_bytes and info.free_memory_bytes > 0
    assert configure_cpu_threads() == 1 and torch.get_num_threads() == 1


def test_a_precision_the_device_cannot_run_is_one_line():
    from rlkit.accel import check_precision
    from rlkit.errors import UserError

    cpu, old_cpu = describe(Probe(bf16_supported=True)), describe(Probe(bf16_supported=False))
    v100 = describe(Probe(cuda_available=True, device_count=1, device_name="Tesla V100", bf16_supported=False))
    for info, dtype in ((cpu, "fp32"), (cpu, "bf16"), (cpu, "auto"), (old_cpu, "fp32"), (v100, "fp16")):
        check_precision(dtype, info)
    with pytest.raises(UserError, match=r"^model.dtype: fp16 does not train on cpu \(cpu: DeepSpeed's fp16 loss "
                                        r"scaling runs on GPUs and NPUs\): use bf16 or fp32, or auto$"):
        check_precision("fp16", cpu)
    with pytest.raises(UserError, match=r"^qlora.compute_dtype: bf16 does not run on cpu \(cpu; this CPU has no "
                                        r"native bf16 \(AVX512-BF16 or AMX\)\): use fp32, or auto$"):
        check_precision("bf16", old_cpu, "qlora.compute_dtype")
    with pytest.raises(UserError, match=r"^model.dtype: bf16 does not run on Tesla V100 \(cuda; it has no bf16\): "
                                        r"use fp16 or fp32, or auto$"):
        check_precision("bf16", v100)
