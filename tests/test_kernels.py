"""`model.kernels`: Liger's kernels where they apply, one line where asked for and they cannot (a
missing package or an unknown family on a GPU host; a CPU host's line: tests/test_library_values.py)."""

from __future__ import annotations

import torch

from rlkit.model.kernels import apply_kernels, kernels_problem


def test_what_liger_needs_on_a_gpu_host(monkeypatch):
    import rlkit.model.kernels as kernels

    monkeypatch.setattr(kernels, "liger_families", lambda: None)
    assert "needs the liger-kernel package" in kernels_problem("liger", "cuda", "qwen2")
    monkeypatch.setattr(kernels, "liger_families", lambda: {"qwen2": print, "llama": print})
    assert kernels_problem("liger", "cuda", "qwen2") is None
    assert kernels_problem("liger", "rocm", "llama") is None
    assert kernels_problem("liger", "cuda", "opt") == "Liger has no kernels for opt models: use auto or none"
    assert kernels_problem("auto", "cpu", "opt") is None and kernels_problem("none", "npu", "qwen2") is None


def test_auto_leaves_a_cpu_model_as_transformers_built_it(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    norm = type(model.model.norm)
    assert not apply_kernels(model, "auto", "cpu") and not apply_kernels(model, "none", "cuda")
    assert type(model.model.norm) is norm
