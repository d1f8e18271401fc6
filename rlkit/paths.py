"""The recipe's file paths, resolved once against the folder where the user ran rlkit.

Learners, engines and a teacher run in Ray actors whose working folder is their raylet's (where
`ray start` ran), not the driver's: a relative `output_dir` would have the actors write under
one folder and the driver look under another, a relative model path would be looked up there (or
taken for a hub id). `prepare_inputs` therefore makes every path key absolute before anything
reaches an actor; the run's config.yaml keeps them so, and a resumed run's saved config is read
the same way (`absolute_paths` on its plain data) before it is compared.

A model path that is not a folder here and has the form `org/name` is a hub id and stays as
written (as `check_model_path` decides); everything else is a local path. Module specs of reward
functions, tools and environments are imported on the driver (`file.py:fn` beside the recipe) and
shipped by value, so they are not paths here.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

MODEL_KEYS = ("model.path", "model.tokenizer", "distill.teacher.path", "distill.teacher.tokenizer")
LOCAL_KEYS = ("output_dir", "data.train", "data.eval", "checkpoint.resume")
RESUME_WORDS = ("auto", "never")  # checkpoint.resume values that are not a folder


def is_hub_id(path: str) -> bool:
    """`org/name` with no local folder `org`: a model hub id, not a relative path."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None and not Path(path.split("/")[0]).exists()


def absolute(path: str, cwd: str | None = None) -> str:
    """`path` against `cwd` (default: the current folder), `~` expanded, as the user spelled it
    otherwise (no symlink resolved: a shared file system's name stays the one every node has)."""
    return os.path.normpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(path)))


def absolute_paths(tree: dict[str, Any], cwd: str | None = None) -> dict[str, Any]:
    """A copy of the plain recipe data `tree` with every path key absolute; idempotent."""
    out = copy.deepcopy(tree)
    for dotted in (*MODEL_KEYS, *LOCAL_KEYS):
        *sections, last = dotted.split(".")
        node = out
        for name in sections:
            node = node.get(name) if isinstance(node, dict) else None
        value = node.get(last) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or (dotted in MODEL_KEYS and is_hub_id(value)) or \
                (dotted == "checkpoint.resume" and value in RESUME_WORDS):
            continue
        node[last] = absolute(value, cwd)
    return out


def with_absolute_paths(cfg: Any) -> Any:
    """The stage config `cfg` with `absolute_paths` applied (a frozen config, rebuilt and checked)."""
    from rlkit.recipe import build, to_dict

    return build(type(cfg), absolute_paths(to_dict(cfg)), "the resolved config")
