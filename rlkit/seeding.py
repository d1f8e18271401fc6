"""Seeds: one way to derive every seed of a run from the recipe's `seed`.

`derive_seed(cfg.seed, "generate", step, attempt)` names what the seed is for, so two uses can
never collide by arithmetic (as `seed + step` and `seed + index` do) and adding a use changes
no other seed.
"""

from __future__ import annotations

import hashlib
import random


def derive_seed(*parts: int | str, bits: int = 62) -> int:
    """A seed in [0, 2**bits) from the parts (ints and labels), the same in every process and run.

    62 bits leave room for vLLM, which seeds the k-th sample of a request with `seed + k`; a
    seed that also seeds numpy's global generator (vLLM's engine seed) needs `bits=31`.
    """
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (when installed) numpy's global generators."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
