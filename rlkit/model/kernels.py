"""Liger's Triton kernels in the learner's model (`model.kernels`): RMSNorm, SwiGLU and RoPE.

`auto` applies them on a CUDA device where the liger-kernel package is installed and has kernels
for the model's family; `liger` asks for them (one line before launch where they cannot apply);
`none` keeps transformers' own modules. Liger's fused cross-entropy is not applied: the learner
computes its token logprobs itself (`rlkit/engine/head.py`). Liger swaps the classes and the
rotary function of the family's transformers module, for the whole process: it runs in learner
processes only (vLLM's engines use their own model code).
"""

from __future__ import annotations

from typing import Any

from rlkit.errors import UserError

KERNEL_DEVICES = ("cuda", "rocm")  # Triton's; `auto` uses CUDA only (ROCm / DCU: ask for liger)


def liger_families() -> dict[str, Any] | None:
    """Liger's apply functions by model type, or None when liger-kernel does not import here."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - missing, or a Triton that does not import: no kernels
        return None
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def kernels_problem(kernels: str, device_kind: str, model_type: str) -> str | None:
    """Why `model.kernels: liger` cannot apply to a `model_type` model on `device_kind` (one line),
    or None (also for `auto` and `none`, which never fail)."""
    if kernels != "liger":
        return None
    if device_kind not in KERNEL_DEVICES:
        return (f"liger runs Triton kernels on a GPU, and this run's learners are on {device_kind}: use auto (Liger "
                "where it applies) or none")
    families = liger_families()
    if families is None:
        return "liger needs the liger-kernel package (pip install liger-kernel, or rlkit's cuda extra): or use auto"
    if model_type not in families:
        return f"Liger has no kernels for {model_type or 'this'} models: use auto or none"
    return None


def check_kernels(model: Any, device: Any, model_type: str, key: str = "model.kernels") -> None:
    """Before launch: `model.kernels` (a `ModelConfig`'s, recipe key `key`) can apply here, else a
    `UserError`."""
    problem = kernels_problem(model.kernels, device.kind, model_type)
    if problem:
        raise UserError(problem, key)


def apply_kernels(model: Any, kernels: str, device_kind: str) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE in `model` (a transformers model) as `kernels` says, on a
    learner's `device_kind`; True when they were applied."""
    if kernels == "none" or device_kind not in (KERNEL_DEVICES if kernels == "liger" else ("cuda",)):
        return False
    families = liger_families()
    model_type = getattr(model.config, "model_type", "")
    if families is None or model_type not in families:
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return True


def with_kernels(model: Any, kernels: str, device_kind: str) -> Any:
    """`model` (a frozen reference or teacher, loaded) after `apply_kernels`."""
    apply_kernels(model, kernels, device_kind)
    return model
