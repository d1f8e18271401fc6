"""What the rollout, learner and sync tests share (`tests/rollout/`, `tests/learner/`, `tests/sync/`):
tiny tied/untied Qwen2 models built once per session, HF reference logprobs; for the CUDA tests, a
one-rank NCCL group and learners built and released per test. Its fixtures are the suite's
(`tests/conftest.py`), so that the session's ones are made once whichever folder asks."""

from __future__ import annotations

import datetime
import gc
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port

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


# ------------------------------------------------------------------ CUDA learners (tests marked gpu)


def deepspeed_problem() -> str | None:
    """Why DeepSpeed cannot be used here (None: it imports)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an import that fails in any way means the same here
        return f"DeepSpeed does not import here ({type(e).__name__}: {str(e)[:200]})"
    return None


CUDA = torch.cuda.is_available()
DS_PROBLEM = deepspeed_problem() if CUDA else None
# A module of CUDA learner tests: marked gpu, skipped without a CUDA device or without DeepSpeed.
CUDA_LEARNER_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
    pytest.mark.skipif(DS_PROBLEM is not None, reason=DS_PROBLEM or ""),
]


@pytest.fixture(scope="session")
def process_group():
    """One NCCL group of one rank for the session (DeepSpeed keeps the groups it derives from the
    first one: a second group in the same process is unknown to them), as `Learner.init_process_group` joins it in an
    actor (that method asks Ray for the node's address; here the environment is set directly)."""
    import deepspeed

    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=120))
    try:
        assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
        t = torch.full((4,), 3.0, device="cuda")
        torch.distributed.all_reduce(t)  # the group works (one rank: the sum is the tensor)
        assert t.tolist() == [3.0] * 4
        yield
    finally:
        torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def learners(process_group):
    """`make(model_dir, zero, ...)` builds a bf16 full fine-tuning learner on CUDA; all are released
    after the test (ZeRO-3's HF config is process-wide: a learner left alive would make the next
    test's model load partitioned)."""
    built = []

    def make(model_dir: Path, zero: int, *, lr: float = 2e-3, micro: int = 4, total_steps: int = 10,
             model: dict | None = None, **frozen):
        from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig
        from rlkit.learner.actor import Learner, LearnerSpec

        spec = LearnerSpec(ModelConfig(path=str(model_dir), dtype="bf16", **(model or {})), "full", None, None,
                           OptimConfig(lr=lr, scheduler="constant", max_grad_norm=1.0),
                           DeepSpeedConfig(zero_stage=zero), micro_batch_size=micro, grad_accum=1,
                           total_steps=total_steps, seed=0, device="cuda", **frozen)
        learner = Learner(spec, rank=0, world_size=1)
        built.append(learner)
        return learner, learner.build()

    yield make
    for learner in built:
        if learner.engine is not None and hasattr(learner.engine, "destroy"):
            learner.engine.destroy()
        learner.engine = learner.reference = learner.teacher = learner._ds_hf_config = None
    built.clear()
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    gc.collect()
    torch.cuda.empty_cache()


def learner_estimate(cfg, stage: str, model_dir: Path):
    """`rlkit estimate`'s learner process for `cfg` on 1xH100, and its total less the "context"
    (the CUDA context and allocator slack, which torch's allocator never counts)."""
    from rlkit import estimate as est
    from rlkit import stages

    arch = est.Arch.from_config(*est.config_json(str(model_dir)))
    learner = est.estimate(cfg, stages.memory(stage), arch, est.Hardware.parse("1xH100"))[0]
    return learner, learner.total - learner.parts.get("context", 0.0)


class CudaPeak:
    """torch's peak allocation over a `with` block, above what was allocated when it began."""

    def __enter__(self):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        self.peak = torch.cuda.max_memory_allocated() - self.start
        self.reserved = torch.cuda.max_memory_reserved()
