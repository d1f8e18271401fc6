"""Atomic, resumable checkpoints: `<root>/step-<N>/` appears only once it is complete.

Learners write their engine state into `<root>/.tmp-step-<N>/`; the driver then writes
`rlkit_state.json` (step, sampler, metrics needed to resume) and renames the directory.
A `kill -9` at any moment leaves either the previous checkpoints or the new one, never half.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "rlkit_state.json"
_STEP = re.compile(r"^step-(\d+)$")


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + fsync + rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        """Write the driver state, publish the checkpoint by rename, prune old ones."""
        atomic_write_text(staging / STATE_FILE, json.dumps({**state, "step": step}))
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
    """`auto`: newest complete checkpoint (or none); `never`: none; else that directory."""
    if resume == "never":
        return None
    if resume == "auto":
        return manager.latest()
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        from rlkit.errors import UserError

        raise UserError(f"checkpoint.resume: {resume} is not a complete rlkit checkpoint (no {STATE_FILE})")
    return path
