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


# a row of the table: the registry's module, and what a module that branches on its entries compares
# (the names of the values it reads, the entries' names)
def _rows() -> dict[str, tuple[str, tuple[str, ...], set[str]]]:
    from rlkit.accel import DEVICES, Kind
    from rlkit.data.containers import _KINDS
    from rlkit.grpo.advantages import ADVANTAGES
    from rlkit.grpo.loss import LOSS_TYPES
    from rlkit.transports import TRANSPORTS

    devices = {*typing.get_args(Kind), *(kind for _, _, kind in DEVICES.values()), "nccl", "hccl", "gloo"}
    return {"a GRPO loss": ("rlkit.grpo.loss", ("loss_type",), set(LOSS_TYPES)),
            "an advantage estimator": ("rlkit.grpo.advantages", ("advantage", "estimator"), set(ADVANTAGES)),
            "a weight-sync transport": ("rlkit.transports", ("sync", "transport", "payload", "name"),
                                        {*TRANSPORTS, "weights", "adapter"}),
            "an accelerator": ("rlkit.accel", ("kind", "ray_resource", "dist_backend", "backend", "torch_device"),
                               devices),
            "a file kind of rows": ("rlkit.data.containers", ("suffix", "kind"), set(_KINDS)),
            "a stage": ("rlkit.stages", (), set())}  # its names: tests/test_structure.py's sniffing check


def _touched(row: str) -> set[str]:
    """The modules of rlkit a row's "files it touches" cell names."""
    line = next(line for line in _table().splitlines() if line.startswith(f"| {row} |"))
    cell = line.split(" | ")[1]
    return {p[:-3].replace("/", ".") for p in re.findall(r"`(rlkit/[^`\s]+\.py)`", cell)}


def _branches(tree, names: tuple[str, ...], entries: set[str]) -> list[int]:
    """The lines where `tree` compares a value called one of `names` with one of `entries`."""
    import ast

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        called = {getattr(s, "attr", None) or getattr(s, "id", None) for s in sides}
        consts = {c.value for s in sides for c in (s.elts if isinstance(s, ast.Tuple | ast.List | ast.Set) else [s])
                  if isinstance(c, ast.Constant)}
        if called & set(names) and consts & entries:
            found.append(node.lineno)
    return found


def test_the_files_a_row_names_are_what_a_change_of_that_kind_touches():
    """Each module of rlkit a row names is the registry's or reads it, and no module the row leaves out
    branches on the registry's names: a new loss, transport, accelerator or file kind is the row's
    files (counted from the code), nothing else."""
    import ast

    from tests.source_graph import imports_of, sources_of

    sources = sources_of()
    rows, wrong = _rows(), []
    assert {line.split(" | ")[0][2:] for line in _table().splitlines() if line.startswith("| a")} >= set(rows)
    for row, (registry, names, entries) in rows.items():
        touched = _touched(row)
        assert registry in touched, row
        wrong += [f"{row}: {m} does not read {registry}" for m in sorted(touched)
                  if m != registry and registry not in imports_of(m, sources[m], set(sources))]
        for module, path in sources.items():
            if module.startswith("rlkit") and module not in touched:
                lines = _branches(ast.parse(path.read_text(encoding="utf-8")), names, entries)
                wrong += [f"{row}: {path.relative_to(ROOT)}:{n} compares with its names" for n in lines]
    assert wrong == []


def test_the_branch_check_sees_a_branch():
    import ast

    tree = ast.parse("if cfg.loss_type == 'dapo': pass\nif device.kind in ('npu', 'x'): pass\nif x == 'dapo': pass")
    assert _branches(tree, ("loss_type",), {"dapo"}) == [1]
    assert _branches(tree, ("kind",), {"npu"}) == [2]
