"""`model.kernels`: Liger's kernels where they apply, one line where asked for and they cannot (a
missing package or an unknown family on a GPU host; a CPU host's line: tests/test_library_values.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlkit.model.kernels import apply_kernels, kernels_problem
from tests.helpers import ROOT


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


@pytest.mark.parametrize("check", ["kernels", "instance", "step", "step-lora"])
def test_liger_under_triton_s_interpreter(tiny_model, check):
    """tests/interpreted.py's check in a process run by Triton's interpreter: each kernel against
    transformers' module; the kernels in the one patched instance, transformers' code for a model
    built afterwards; rlkit's SFT and GRPO objectives through its head on the patched model against
    the unpatched one, full and LoRA (losses, logprobs, entropy, gradients)."""
    res = subprocess.run([sys.executable, "-m", "tests.interpreted", check, str(tiny_model)], cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


def test_liger_asked_for_on_a_host_without_it_is_one_line_from_that_host(tiny_model, monkeypatch):
    """The learner's own check where it builds the model (a learner host may lack what the driver has)."""
    import socket

    from transformers import AutoModelForCausalLM

    import rlkit.model.kernels as kernels
    from rlkit.errors import UserError

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    monkeypatch.setattr(kernels, "liger_families", lambda: None)
    with pytest.raises(UserError, match=rf"^model.kernels: on host {socket.gethostname()}: liger needs the "
                                        r"liger-kernel package .*: or use auto$"):
        apply_kernels(model, "liger", "cuda")
    with pytest.raises(UserError, match=r"^distill.teacher.kernels: on host .*: liger runs Triton kernels on a GPU"):
        kernels.with_kernels(model, "liger", "cpu", "distill.teacher.kernels")
