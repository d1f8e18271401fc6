"""What an engine loads: buckets of `(hf_name, tensor)` in HF checkpoint naming.

`bucketize` groups the tensors a learner yields for a transport; buckets never split a transformer
layer (`...layers.<i>.`), because vLLM fuses q/k/v and gate/up into one parameter and processes a
layer once all its parts are loaded. `FlatBucket` is one bucket in one byte buffer, as the
transports move it and the engines read it in place.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

NamedTensor = tuple[str, torch.Tensor]
_LAYER_KEY = re.compile(r"^(.*?\.layers\.\d+)\.")


@dataclass(frozen=True)
class FlatBucket:
    """A bucket's tensors in one byte buffer: what a transport moves in one piece (one object in
    the store, one broadcast) instead of one per tensor. `entries`: (name, dtype name, shape, byte
    offset) per tensor, each at a multiple of `ALIGN` bytes; `data`: uint8 [bytes], a torch tensor
    (on any device) or, once it crossed a pickle (the object store), a numpy array the engine
    reads in place."""

    entries: list[tuple[str, str, tuple[int, ...], int]]
    data: Any

    ALIGN = 64

    @classmethod
    def pack(cls, named: Iterable[NamedTensor], device: Any = "cpu", dtype: torch.dtype | None = None) -> FlatBucket:
        """The tensors `named` copied into one new buffer on `device` (cast to `dtype` if given)."""
        named = [(n, t.detach()) for n, t in named]
        sizes = [t.numel() * (dtype or t.dtype).itemsize for _, t in named]
        offsets = [sum(-(-n // cls.ALIGN) * cls.ALIGN for n in sizes[:i]) for i in range(len(sizes))]
        data = torch.empty(offsets[-1] + sizes[-1] if named else 0, dtype=torch.uint8, device=device)
        entries = []
        for (name, tensor), size, at in zip(named, sizes, offsets):
            kind = dtype or tensor.dtype
            data[at:at + size].view(kind).view(tensor.shape).copy_(tensor)
            entries.append((name, str(kind).removeprefix("torch."), tuple(tensor.shape), at))
        return cls(entries, data)

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])

    def tensors(self) -> Iterator[NamedTensor]:
        """(name, tensor) per entry: views of the buffer, no copy."""
        import warnings

        data = self.data
        if not isinstance(data, torch.Tensor):
            with warnings.catch_warnings():  # the object store's buffers are read-only: they are only read here
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(data)
        for name, dtype, shape, at in self.entries:
            kind = getattr(torch, dtype)
            yield name, data[at:at + math.prod(shape) * kind.itemsize].view(kind).view(shape)

    def __reduce__(self) -> tuple[Any, ...]:
        """A CPU buffer crosses as numpy, which Ray's object store keeps out of band (no copy)."""
        data = self.data.numpy() if isinstance(self.data, torch.Tensor) else self.data
        return FlatBucket, (self.entries, data)


def _group_key(name: str) -> str:
    match = _LAYER_KEY.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


def bucketize(named: Iterable[NamedTensor], bucket_mib: float) -> Iterator[list[NamedTensor]]:
    """Group consecutive tensors into buckets of about `bucket_mib` MiB.

    Tensors of one layer group (same `...layers.<i>` prefix, else same module) stay in one
    bucket even if the group alone exceeds the budget.
    """
    budget = bucket_mib * 2**20
    bucket: list[NamedTensor] = []
    group: list[NamedTensor] = []
    size = group_size = 0
    key = None
    for name, tensor in named:
        k = _group_key(name)
        if k != key and group:
            if bucket and size + group_size > budget:
                yield bucket
                bucket, size = [], 0
            bucket, size = bucket + group, size + group_size
            group, group_size = [], 0
        key = k
        group.append((name, tensor))
        group_size += tensor.numel() * tensor.element_size()
    if bucket and size + group_size > budget:
        yield bucket
        bucket = []
    if bucket or group:
        yield bucket + group
