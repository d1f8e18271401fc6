"""What a run may do in an `output_dir` that already holds a run.

- A checkpoint to resume from: the run resumes. The keys whose value differs from the config
  that checkpoint was trained with are printed; the ones a stage cannot change mid-run (the
  model, the data, the batch shape: its config's `RESUME_FIXED`) are refused unless
  `checkpoint.force_resume: true`.
- No checkpoint: a previous run of the same recipe that did not finish (killed before its first
  checkpoint), or a launch of any recipe that stopped before its first metrics, is started over.
  A finished run (`final/`), a run of another recipe, or checkpoints that
  `checkpoint.resume: never` leaves unused are refused unless `overwrite: true`, which then
  removes that run's outputs (checkpoints, final model, metrics) before the new run starts.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from rlkit.errors import UserError
from rlkit.paths import absolute_paths

log = logging.getLogger("rlkit")
CONFIG_FILE = "config.yaml"
# the files and folders a run writes in output_dir (rlkit.log is kept: it is appended to)
OUTPUTS = ("final", ".tmp-final", "checkpoints", "metrics.jsonl", "rollouts.jsonl", "tensorboard", CONFIG_FILE)
# keys that may differ between two invocations of the same run
NOT_COMPARED = ("overwrite", "checkpoint.force_resume", "checkpoint.resume")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as `{dotted.key: value}` (`rewards[0].fn` for list items)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, list) and tree and any(isinstance(v, (dict, list)) for v in tree):
        out = {}
        for i, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: tree}


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`{key: (old, new)}` for every dotted key whose value differs (a missing key is None); paths
    compare absolute (a config.yaml of old may hold them relative to the folder the run started in)."""
    a, b = flatten(absolute_paths(old)), flatten(absolute_paths(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not k.startswith(NOT_COMPARED)}


def is_fixed(key: str, fixed: tuple[str, ...]) -> bool:
    return any(key == f or key.startswith((f + ".", f + "[")) for f in fixed)


def describe(diff: dict[str, tuple[Any, Any]], most: int = 6) -> str:
    """`key: old -> new; ...`, the first `most` of them."""
    shown = "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in list(diff.items())[:most])
    return shown + (f"; and {len(diff) - most} more" if len(diff) > most else "")


def check_resume(ckpt: Path, run_dir: Path, config: dict[str, Any], fixed: tuple[str, ...], force: bool) -> None:
    """Compare `config` (the resolved recipe, with its `stage`) with the one `ckpt` was trained
    with: print what changed, refuse a change of a `fixed` key unless `force`."""
    saved = ckpt / CONFIG_FILE
    if not saved.is_file() and ckpt.resolve().is_relative_to(run_dir.resolve()):
        saved = run_dir / CONFIG_FILE  # checkpoints written before they carried their config
    if not saved.is_file():
        log.warning("resuming from %s: it has no %s, so the config it was trained with is not compared", ckpt,
                    CONFIG_FILE)
        return
    diff = changes(_read(saved), config)
    if not diff:
        return
    if "stage" in diff:
        raise UserError(f"checkpoint.resume: {ckpt} is a checkpoint of `rlkit {diff['stage'][0]}`, not of `rlkit "
                        f"{diff['stage'][1]}`: resume from one of this stage (an SFT model goes in model.path)")
    locked = {k: v for k, v in diff.items() if is_fixed(k, fixed)}
    if locked and not force:
        raise UserError(f"checkpoint.resume: {ckpt} was trained with another {describe(locked)}; these cannot "
                        "change mid-run: put them back, start in another output_dir, or set "
                        "checkpoint.force_resume: true to resume anyway")
    log.warning("resuming from %s with a changed config: %s", ckpt, describe(diff))


def check_fresh_start(run_dir: Path, config: dict[str, Any], overwrite: bool) -> None:
    """Before a run with nothing to resume starts in `run_dir`: refuse to replace another run's
    outputs unless `overwrite`; clear them when it may."""
    present = [name for name in OUTPUTS if _written(run_dir / name)]
    if not present:
        return
    saved = run_dir / CONFIG_FILE
    diff = changes(_read(saved), config) if saved.is_file() else None
    if (run_dir / "final").exists():
        other = "a finished run (final/)"
    elif "checkpoints" in present:
        other = "checkpoints that checkpoint.resume: never does not resume from"
    elif not {"metrics.jsonl", "rollouts.jsonl"} & set(present):
        other = ""  # a launch that stopped before its first metrics (no resources, a bad node...): start over
    elif diff is None:
        other = f"run outputs ({', '.join(present)}) but no {CONFIG_FILE}"
    elif diff:
        other = f"a run of another recipe ({describe(diff, most=4)})"
    else:
        other = ""  # this recipe's own run, stopped before its first checkpoint: start it over
    if other and not overwrite:
        raise UserError(f"output_dir: {run_dir} holds {other}; choose another output_dir, or set overwrite: true "
                        "to replace it")
    for name in present:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if other:
        log.warning("overwrite: true: removed %s from %s (%s)", ", ".join(present), run_dir, other)
    else:
        log.warning("%s holds an unfinished run with no checkpoint: starting it over", run_dir)


def _written(path: Path) -> bool:
    """Whether `path` exists and, for a folder, holds something."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
