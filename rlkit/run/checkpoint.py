"""Atomic, verified, resumable checkpoints: `<root>/step-<N>/` appears only once it is complete.

Learners write their engine state into `<root>/.tmp-step-<N>/`; the driver then writes
`rlkit_state.json` (step, sampler, metrics needed to resume), then `manifest.json` (every
file's size and hash), and renames the directory. A `kill -9` at any moment leaves either the
previous checkpoints or the new one, never half.

A checkpoint damaged later (a truncated copy, a lost rank file) fails `verify`: `resume: auto`
then falls back to the newest intact one with a warning, an explicit `resume: PATH` is an error;
`read_resume` gives back what one holds for the driver (step, state, payload).
Every write of a run's outputs goes through `writing`: what fails leaves nothing half-written,
and a full disk is one line naming the path and the bytes it needed.
The hash is blake2b over the whole file up to 64 MiB, and over 64 evenly spaced 1 MiB blocks
(first and last included) beyond: sizes catch truncation, the blocks most damage, and
verifying a 100 GB checkpoint reads 64 MiB per file, not 100 GB.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.errors import FaultError, UserError

STATE_FILE = "rlkit_state.json"
MANIFEST = "manifest.json"
PAYLOAD_FILE = "driver_payload.pt"
FULL_BELOW = 64 << 20  # free bytes under which a failed write is put down to a full disk
_STEP = re.compile(r"^step-(\d+)$")
_BLOCK, _WHOLE, _BLOCKS = 1 << 20, 64 << 20, 64
log = logging.getLogger("rlkit")


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + fsync + rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_hash(path: Path, size: int) -> str:
    """blake2b of the file (up to 64 MiB) or of 64 evenly spaced 1 MiB blocks of it."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= _WHOLE:
            while chunk := f.read(_BLOCK):
                h.update(chunk)
        else:
            for i in range(_BLOCKS):
                f.seek((size - _BLOCK) * i // (_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def write_manifest(ckpt: Path) -> None:
    """`manifest.json`: size and hash of every file under `ckpt`, written last and atomically."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = path.stat().st_size
        files[path.relative_to(ckpt).as_posix()] = {"size": size, "blake2b": file_hash(path, size)}
    atomic_write_text(ckpt / MANIFEST, json.dumps({"version": 1, "files": files}, indent=0))


def verify(ckpt: Path) -> str | None:
    """None if `ckpt` is intact; else what is wrong with it, as a phrase."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"its {MANIFEST} is damaged"
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']}"
        if file_hash(path, size) != want["blake2b"]:
            return f"{name} does not match its hash in the manifest"
    return None


def dir_bytes(path: str | Path) -> int:
    """The size of the files under `path` (0 if it does not exist)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    def staging_dir(self, step: int) -> Path:
        """An empty directory for the learners to write step `step` into."""
        tmp = self.root / f".tmp-step-{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, staging: Path, step: int, state: dict[str, Any], protect: set[int] = frozenset()) -> Path:
        """Write the driver state and the manifest, publish the checkpoint by rename, prune old ones."""
        atomic_write_text(staging / STATE_FILE, json.dumps({**state, "step": step}))
        write_manifest(staging)
        final = self.root / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        self.prune(protect)
        return final

    def steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending."""
        found = []
        for p in self.root.iterdir() if self.root.exists() else []:
            m = _STEP.match(p.name)
            if m and (p / STATE_FILE).exists():
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step-{steps[-1]}" if steps else None

    def prune(self, protect: set[int] = frozenset()) -> None:
        """Keep the newest `keep_last` checkpoints plus `protect` (e.g. the best one); drop stale temps."""
        steps = self.steps()
        for step in steps[:-self.keep_last]:
            if step not in protect:
                shutil.rmtree(self.root / f"step-{step}", ignore_errors=True)
        for p in self.root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def load_state(ckpt: Path) -> dict[str, Any]:
        return json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))


def resolve_resume(manager: CheckpointManager, resume: str) -> Path | None:
    """`auto`: the newest intact checkpoint (none if there are none; damaged newer ones are
    skipped with a warning); `never`: none; else that directory, which must be intact."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_FILE).exists():
            raise UserError(f"checkpoint.resume: {resume} is not a complete rlkit checkpoint (no {STATE_FILE})")
        if problem := verify(path):
            raise UserError(f"checkpoint.resume: {resume} is damaged: {problem}; resume from another checkpoint "
                            "(checkpoint.resume: auto picks the newest intact one)")
        return path
    damaged = []
    for step in reversed(manager.steps()):
        path = manager.root / f"step-{step}"
        if not (problem := verify(path)):
            break
        damaged.append(f"{path.name}: {problem}")
        log.warning("checkpoint %s is damaged (%s); trying the one before it", path, problem)
    else:
        if damaged:
            raise UserError(f"checkpoint.resume: auto: no intact checkpoint in {manager.root} "
                            f"({'; '.join(damaged)}); move them away to start over, or resume from a copy")
        return None
    if damaged:
        log.warning("resuming from %s, the newest intact checkpoint", path)
    return path


@dataclass(frozen=True)
class Resumed:
    """What a run resumes from: the step its checkpoint was written after (0: a fresh start), the
    sampler's state, the driver's state (plain values) and its payload (tensors and containers:
    e.g. generations in flight; None without one)."""

    step: int = 0
    sampler: dict[str, Any] | None = None
    driver: dict[str, Any] = field(default_factory=dict)
    payload: Any = None


def read_resume(ckpt: Path | None) -> Resumed:
    """The driver's side of checkpoint `ckpt` (a fresh start's when None)."""
    if ckpt is None:
        return Resumed()
    state = CheckpointManager.load_state(ckpt)
    payload = None
    if (ckpt / PAYLOAD_FILE).exists():
        import torch

        payload = torch.load(ckpt / PAYLOAD_FILE, weights_only=True)
    return Resumed(state["step"], state["sampler"], state.get("driver", {}), payload)


@contextmanager
def writing(staging: Path, what: str, needed: int | None) -> Iterator[None]:
    """Remove `staging` if the writes inside fail; a full disk becomes a one-line `FaultError`
    naming the path and the bytes `what` needs (`needed`, else at least what it wrote)."""
    try:
        yield
    except BaseException as e:
        written = dir_bytes(staging)
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(e, Exception) or not disk_full(e, staging):
            raise
        free = shutil.disk_usage(_existing(staging)).free
        need = (f"about {_size(needed)}" if needed else f"more than {_size(written)}") + f", {_size(free)} free"
        raise FaultError(f"{what}: the disk is full under {staging.parent} (it needs {need}): "
                         "free some space") from e


def disk_full(error: BaseException, path: Path) -> bool:
    """Whether `error` (raised writing under `path`) came from a full disk: ENOSPC / EDQUOT in its
    chain (through Ray task errors too), or almost no space left where it wrote. torch.save on a
    full disk raises a RuntimeError ("unexpected pos ...") with no errno, hence the second test."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    return shutil.disk_usage(_existing(path)).free < FULL_BELOW


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
