"""docs/layout.md's "Extending rlkit" table stays true: every path it names exists, and each
registry's entries appear on the page the table says documents them (a loss, an estimator, a
transport, a shipped reward, a file kind, an accelerator or a stage added without its docs fails here)."""

import importlib
import inspect
import re
import typing

from tests.helpers import ROOT


def _table() -> str:
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    return text[text.index("## Extending rlkit"):]


def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def test_every_path_the_table_names_exists():
    paths = [p for p in re.findall(r"`([^`\s]+)`", _table()) if "/" in p and "<" not in p and ":" not in p]
    assert len(paths) > 15
    missing = [p for p in paths if not (ROOT / p.rstrip("/")).exists()]
    assert missing == []


def test_each_registry_is_on_the_page_the_table_names():
    from rlkit.accel import Kind
    from rlkit.data.containers import _KINDS
    from rlkit.grpo.advantages import ADVANTAGES
    from rlkit.grpo.loss import LOSS_TYPES
    from rlkit.stages import TABLE
    from rlkit.transports import TRANSPORTS

    grpo = _page("grpo.md")

    def named(name: str, text: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None
    missing = [f"loss {n}" for n in LOSS_TYPES if not named(n, grpo)]
    missing += [f"advantage {n}" for n in ADVANTAGES if not named(n, grpo)]
    missing += [f"transport {n}" for n in TRANSPORTS if not named(n, grpo)]
    recipes = _page("recipes.md")
    missing += [f"file kind {s}" for s in _KINDS if s not in recipes]
    missing += [f"accelerator {k}" for k in typing.get_args(Kind) if k not in _page("accelerators.md").lower()]
    pages = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    missing += [f"stage {s}" for s in TABLE if f"rlkit {s}" not in pages]
    rewards = _page("rewards.md")
    for module in sorted((ROOT / "rewards").glob("*.py")):
        mod = importlib.import_module(f"rewards.{module.stem}")
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ == mod.__name__ and hasattr(fn, "rlkit_range") and f"{module.stem}:{name}" not in rewards:
                missing.append(f"reward rewards.{module.stem}:{name}")
    assert missing == []


def test_each_stage_row_names_what_its_package_owns():
    """A stage row resolves to its recipe type, driver and memory model, each in the stage's
    package (an alias shares its target's), so no shared module has to know the stage."""
    from rlkit.config import StageConfig
    from rlkit.estimate.memory import MemoryModel
    from rlkit.stages import TABLE, resolve

    for row in TABLE.values():
        if row.of:
            assert row.of in TABLE and not (row.config or row.run or row.memory), row.name
            continue
        parts = {spec: resolve(spec) for spec in (row.config, row.run, row.memory)}
        assert all(spec.startswith(f"rlkit.{row.name}.") for spec in parts), row.name
        assert issubclass(parts[row.config], StageConfig) and callable(parts[row.run])
        assert isinstance(parts[row.memory], MemoryModel), row.name
