"""vLLM worker extension: in-place weight updates for a running engine.

Passed to vLLM by name (`worker_extension_cls="rlkit.rollout.vllm_ext.WeightSyncExtension"`);
vLLM mixes it into its worker class, so `self` below is the vLLM worker (`self.model_runner`,
`self.device`, `self.rank`). Methods are called from the engine owner through
`llm.collective_rpc("<method>", args=...)` and run on every worker (each TP rank).

All loads go through `worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`:
it takes HF checkpoint names, fuses q/k/v and gate/up itself, and re-runs the per-layer
post-load processing. On CPU the plain `model.load_weights` fails because linear weights are
pre-packed for oneDNN. Tied embeddings are re-packed separately (`_repack_tied_lm_head`).
The caller must reset the engine's prefix cache afterwards (`LLM.reset_prefix_cache()`);
that lives in the engine core, not in the worker.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# vLLM warns once per layer it did not get ("Failed to load weights") and lists every missing
# name; a bucketed sync loads a few layers per call, so those warnings are expected there.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def dtype_name(tensor: torch.Tensor) -> str:
    """The dtype as `getattr(torch, name)` reads it back ("bfloat16", "float32", ...)."""
    return str(tensor.dtype).removeprefix("torch.")


def communicator_class(backend: str) -> Any:
    """The device communicator for a weight-broadcast group over `backend` (`rlkit.accel.COMMUNICATORS`:
    vLLM's PyNccl on CUDA and ROCm's RCCL, vllm-ascend's PyHccl on Ascend NPU)."""
    import importlib

    from rlkit.accel import COMMUNICATORS

    if backend in COMMUNICATORS:
        module, name = COMMUNICATORS[backend].split(":")
        return getattr(importlib.import_module(module), name)
    raise ValueError(f"weight broadcast backend must be one of {', '.join(COMMUNICATORS)}, got {backend!r}")


def pack_tensor(name: str, tensor: torch.Tensor) -> tuple[str, str, tuple[int, ...], bytes]:
    """`(name, dtype name, shape, raw bytes)` of a tensor (any dtype, bf16 included); see
    `unpack_tensor`."""
    data = tensor.detach().to("cpu").contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, dtype_name(data), tuple(data.shape), raw


def unpack_tensor(name: str, dtype: str, shape: tuple[int, ...], raw: bytes) -> tuple[str, torch.Tensor]:
    """Inverse of `pack_tensor`."""
    dt = getattr(torch, dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=dt) if raw else torch.empty(0, dtype=dt)  # frombuffer rejects b""
    return name, flat.reshape(shape)


class WeightSyncExtension:
    """Methods added to the vLLM worker for weight sync and debugging."""

    # ------------------------------------------------------------------ loading

    def load_weights_from_iter(self, named_tensors: NamedTensors) -> int:
        """Load HF-named tensors in place; returns the number of tensors loaded.

        `named_tensors` may be a list (sent over RPC) or, in-process, any iterable; all weights
        of one fused vLLM layer (q/k/v, gate/up) must arrive within the same call.
        """
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in named_tensors:
                count += 1
                yield name, tensor

        self._rlkit_reload(counted())
        return count

    def load_packed_weights(self, packed: list[tuple[str, str, tuple[int, ...], bytes]]) -> int:
        """`load_weights_from_iter` for tensors sent as raw bytes (`pack_tensor`)."""
        return self.load_weights_from_iter(unpack_tensor(*p) for p in packed)

    def _rlkit_reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        with _quiet_partial_reload():
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self._rlkit_repack_tied_lm_head()

    def _rlkit_repack_tied_lm_head(self) -> None:
        """With tied embeddings vLLM's `lm_head` shares `embed_tokens.weight` but keeps its own
        packed GEMM copy on CPU; re-run its post-load processing so logits use the new weight. A
        vision-language model says it in its text config and may keep the head under its language
        model (Qwen2-VL's `language_model.lm_head`): every `lm_head` module is repacked."""
        from rlkit.model.vision import text_config

        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        text = text_config(config)
        if not (getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)):
            return
        for name, lm_head in model.named_modules():
            quant_method = getattr(lm_head, "quant_method", None)
            if name.rsplit(".", 1)[-1] == "lm_head" and quant_method is not None and hasattr(lm_head, "weight"):
                quant_method.process_weights_after_loading(lm_head)

    # ------------------------------------------------------------------ broadcast (GPU)

    def init_weight_update_group(self, master_addr: str, master_port: int, rank_offset: int,
                                 world_size: int, backend: str = "nccl") -> None:
        """Join a stateless NCCL group with the learner (rank 0); this worker is
        `rank_offset + self.rank`. Needs a CUDA device (HCCL: vllm-ascend's communicator).

        Unverified on CPU (no NCCL); follows vLLM's RLHF example.
        """
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=master_addr, port=master_port,
                                             rank=rank_offset + self.rank, world_size=world_size)
        self._rlkit_comm = communicator_class(backend)(group, device=self.device)

    def update_weights_broadcast(self, entries: list[tuple[str, str, tuple[int, ...], int]], nbytes: int) -> int:
        """Receive one bucket broadcast from rank 0 as a flat buffer of `nbytes` (a `FlatBucket`
        with these `entries`) and load its tensors in one reload. Unverified on CPU (needs a GPU
        check)."""
        from rlkit.rollout.buckets import FlatBucket

        data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._rlkit_comm.broadcast(data, src=0)
        return self.load_weights_from_iter(FlatBucket(entries, data).tensors())

    # ------------------------------------------------------------------ debugging

    def weights_checksum(self) -> dict[str, Any]:
        """sha256 over (name, shape, fp32 bytes) of every vLLM parameter, and their sum."""
        model = self.model_runner.get_model()
        digest = hashlib.sha256()
        total = 0.0
        for name, param in sorted(model.named_parameters()):
            data = param.detach().float().cpu().contiguous()
            digest.update(name.encode())
            digest.update(str(tuple(data.shape)).encode())
            digest.update(data.numpy().tobytes())
            total += float(data.double().sum())
        return {"sha256": digest.hexdigest(), "sum": total}
