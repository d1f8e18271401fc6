"""rlkit's modules and the imports between them, read from the source with `ast` (nothing is
imported): what the structure and the Extending table's tests read."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("rlkit", "rewards")


def sources_of() -> dict[str, Path]:
    """Module name -> file, for every module of rlkit and the shipped rewards."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `name` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            wanted = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in wanted:  # `from rlkit import stages` names the module rlkit.stages
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                break
    return found


def unit(module: str) -> str:
    """A folder of rlkit counts as one unit (`rlkit.rollout`), a top-level file as itself."""
    parts = module.split(".")
    if parts[0] == "rewards" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2]) if (ROOT / parts[0] / parts[1]).is_dir() else module
