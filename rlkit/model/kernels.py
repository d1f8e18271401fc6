"""Liger's Triton kernels in the learner's model (`model.kernels`): RMSNorm, SwiGLU and RoPE.

`auto` applies them on a CUDA device where the liger-kernel package is installed and has kernels
for the model's family; `liger` asks for them (one line before launch where they cannot apply, and
again from the host that builds the model, where that host lacks them); `none` keeps transformers'
own modules. Liger's fused cross-entropy is not applied: the learner computes its token logprobs
itself (`rlkit/learner/head.py`).

The kernels go into the one model instance rlkit built, never into the process: Liger's apply
function swaps the family's classes and its rotary function in the transformers module as well as
patching the instance, so every name it swaps in a transformers module (and every class attribute)
is put back, and a function it swapped (the rotary embedding) is bound into each of the instance's
modules whose forward calls it, through a copy of that forward with Liger's function in its globals.
A model of the same family built afterwards in the same process (a CPU reference, an unpatched
copy) runs transformers' own code.
"""

from __future__ import annotations

import socket
import sys
import types
from typing import Any

from rlkit.accel import of_kind
from rlkit.errors import UserError

KEY = "model.kernels"


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
    if not of_kind(device_kind).triton:  # the device's record says where Triton's kernels run
        return (f"liger runs Triton kernels on a GPU, and this run's learners are on {device_kind}: use auto (Liger "
                "where it applies) or none")
    families = liger_families()
    if families is None:
        return "liger needs the liger-kernel package (pip install liger-kernel, or rlkit's cuda extra): or use auto"
    if model_type not in families:
        return f"Liger has no kernels for {model_type or 'this'} models: use auto or none"
    return None


def check_kernels(model: Any, device: Any, model_type: str, key: str = KEY) -> None:
    """Before launch: `model.kernels` (a `ModelConfig`'s, recipe key `key`) can apply here, else a
    `UserError`."""
    problem = kernels_problem(model.kernels, device.kind, model_type)
    if problem:
        raise UserError(problem, key)


def apply_kernels(model: Any, kernels: str, device_kind: str, key: str = KEY) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE in `model` (a transformers model instance, and nothing else) as
    `kernels` says, on a learner's `device_kind`; True when they were applied. Where `liger` was asked
    for and cannot apply on this host: a `UserError` naming the host and `key`."""
    model_type = getattr(model.config, "model_type", "")
    problem = kernels_problem(kernels, device_kind, model_type)
    if problem:
        raise UserError(f"on host {socket.gethostname()}: {problem}", key)
    info = of_kind(device_kind)
    if kernels == "none" or not (info.triton if kernels == "liger" else info.kernels_auto):
        return False
    families = liger_families()
    if families is None or model_type not in families:
        return False
    swapped = _undone(lambda: families[model_type](model=model, rope=True, rms_norm=True, swiglu=True,
                                                   cross_entropy=False, fused_linear_cross_entropy=False))
    _bind(model, swapped)
    return True


def with_kernels(model: Any, kernels: str, device_kind: str, key: str = KEY) -> Any:
    """`model` (a frozen reference or teacher, loaded) after `apply_kernels`."""
    apply_kernels(model, kernels, device_kind, key)
    return model


def _loaded() -> list[types.ModuleType]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.") and m is not None]


def _classes(module: types.ModuleType) -> list[type]:
    return [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]


def _undone(apply: Any) -> dict[str, dict[str, Any]]:
    """Run `apply`, then put back every name it changed in a loaded transformers module and every
    attribute it changed on their classes. Returns the functions it had swapped in, by the name of
    their module: {module name: {name: Liger's function}}."""
    modules = _loaded()
    names = {m: dict(vars(m)) for m in modules}
    attrs = {c: dict(vars(c)) for m in modules for c in _classes(m)}
    try:
        apply()
    finally:
        swapped: dict[str, dict[str, Any]] = {}
        for module, before in names.items():
            now = vars(module)
            for name in [n for n in now if n not in before or now[n] is not before[n]]:
                if isinstance(now[name], types.FunctionType):
                    swapped.setdefault(module.__name__, {})[name] = now[name]
                if name in before:
                    setattr(module, name, before[name])
                else:
                    delattr(module, name)
        for cls, before in attrs.items():
            now = dict(vars(cls))
            for name in [n for n in now if n not in before or now[n] is not before[n]]:
                if name in before:
                    setattr(cls, name, before[name])
                else:
                    delattr(cls, name)
    return swapped


def _bind(model: Any, swapped: dict[str, dict[str, Any]]) -> None:
    """Each module of `model` whose class's forward calls a swapped function by its global name gets
    its own forward: the same code, with Liger's function in its globals."""
    for module in model.modules():
        if "forward" in vars(module):  # bound on the instance already (Liger's RMSNorm, SwiGLU)
            continue
        forward = type(module).forward
        if not isinstance(forward, types.FunctionType):
            continue
        ours = swapped.get(forward.__globals__.get("__name__", ""), {})
        names = {n: ours[n] for n in forward.__code__.co_names if n in ours}
        if names:
            bound = types.FunctionType(forward.__code__, {**forward.__globals__, **names}, forward.__name__,
                                       forward.__defaults__, forward.__closure__)
            bound.__kwdefaults__ = forward.__kwdefaults__
            module.forward = types.MethodType(bound, module)
