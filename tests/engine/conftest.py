"""Engine test fixtures: tiny tied/untied Qwen2 models built once per session, HF reference logprobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# In-process vLLM engine (no engine-core subprocess), one thread; read when an engine starts.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from rlkit.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {size: build_tiny_model(root / size, size) for size in ("tiny", "tiny-untied")}


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Add N(0, scale^2) noise to every parameter in place (tied weights once)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logprob of seq[t] given seq[:t] for t >= 1, from logits / temperature; shape [len(seq) - 1]."""
    logits = model(torch.tensor([seq])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def vocab_size(path: Path) -> int:
    """The model's vocabulary size (the offline BPE yields fewer tokens than it is asked for)."""
    import json

    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def assert_packed_as_padded(results: list[tuple], grads: list[dict[str, torch.Tensor]], dtype: torch.dtype,
                            tol: float) -> None:
    """The runs [padded, packed] of the same rows: their outputs (`results`, tuples of tensors) agree
    within `tol`, and in fp64 their gradients (`grads`, by parameter name) within 1e-12."""
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
    if dtype == torch.float64:
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-12, rtol=0, msg=name)
