"""The structure stays as built: imports run one way (no circle between rlkit's files or folders),
the actor layer and the shared driver know no stage, nothing outside the stage packages asks a
recipe which stage it is, and no module or function outgrows its guide (ruff's C901 holds the
complexity). Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast

import pytest

from tests.helpers import ROOT
from tests.source_graph import imports_of, sources_of, unit

STAGES = ("rlkit.sft", "rlkit.grpo", "rlkit.distill", "rlkit.dpo", "rlkit.rm", "rlkit.kto", "rlkit.stages")
# the actor layer (the cluster's plumbing, the rollout side, the learner side, what crosses between
# them) and the shared driver
LOWER = ("rlkit.actors", "rlkit.rollout", "rlkit.learner", "rlkit.sync", "rlkit.run", "rlkit.model")
MAX_MODULE_LINES = 360  # tighter than STYLE.md's 400
MAX_FUNCTION_LINES = 60


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    sources = sources_of()
    return {name: imports_of(name, path, set(sources)) - {"rlkit"} for name, path in sources.items()}


def _circles(edges: dict[str, set[str]]) -> list[str]:
    """The nodes left on or between circles: a node nothing imports, or that imports nothing left,
    is taken away until none is; an acyclic graph loses every node."""
    left = {v: set(ws) for v, ws in edges.items()}
    for ws in list(left.values()):
        for w in ws:
            left.setdefault(w, set())
    while True:
        targets = {w for ws in left.values() for w in ws}
        gone = {v for v, ws in left.items() if not ws or v not in targets}
        if not gone:
            return sorted(left)
        left = {v: ws - gone for v, ws in left.items() if v not in gone}


def _why(graph: dict[str, set[str]], part: list[str]) -> list[str]:
    return sorted(f"{a} -> {b}" for a in graph for b in graph[a] if unit(a) in part and unit(b) in part
                  and unit(a) != unit(b))


def test_no_import_circle_between_files_or_folders(graph):
    assert _circles(graph) == []
    folders: dict[str, set[str]] = {}
    for a, targets in graph.items():
        folders.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    circles = _circles(folders)
    assert circles == [], _why(graph, circles)


def test_the_actor_layer_and_the_shared_driver_know_no_stage(graph):
    lower = [m for m in graph if m.startswith(LOWER)]
    assert {m.split(".")[1] for m in lower} == {p.split(".")[1] for p in LOWER}, "the packages are where expected"
    wrong = sorted(f"{m} -> {t}" for m in lower for t in graph[m] if t.startswith(STAGES))
    assert wrong == []


def _stage_facts() -> tuple[set[str], set[str]]:
    """The stage names (the rows of `rlkit/stages.py`) and the sections of their recipe types
    (the fields of `StageConfig` and of each stage's config class)."""
    names = {n.args[0].value for n in ast.walk(ast.parse((ROOT / "rlkit/stages.py").read_text(encoding="utf-8")))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Stage" and n.args}
    sections = set()
    for path, cls in (("rlkit/config.py", "StageConfig"), ("rlkit/sft/config.py", "SFTConfig"),
                      ("rlkit/grpo/config.py", "GRPOConfig")):
        body = next(n for n in ast.parse((ROOT / path).read_text(encoding="utf-8")).body
                    if isinstance(n, ast.ClassDef) and n.name == cls).body
        sections |= {n.target.id for n in body if isinstance(n, ast.AnnAssign) and n.target.id.islower()}
    return names, sections


def _stage_sniffing(tree: ast.AST, names: set[str], sections: set[str]) -> list[str]:
    """Where `tree` asks a recipe which stage it is: `hasattr`/`getattr` of a recipe section by
    its literal name, or a comparison against a stage's name (line: what)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in sections:
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [c for side in sides for c in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set)
                                                    else [side]) if isinstance(c, ast.Constant)]
            found += [f"{node.lineno}: compared with {c.value!r}" for c in consts if c.value in names]
    return found


def test_nothing_below_the_stages_asks_which_stage_a_recipe_is():
    """A stage's checks, memory model and models live in its package and reach the shared code
    through its row and its recipe type: a stage that names a section `rollout` does not get
    GRPO's checks by accident, and a new stage edits no if/else pair elsewhere."""
    names, sections = _stage_facts()
    assert {"sft", "grpo", "distill", "dpo", "rm"} <= names
    assert {"rollout", "distill", "train", "finetuning"} <= sections
    wrong = []
    for name, path in sources_of().items():
        if name.startswith(STAGES):
            continue
        wrong += [f"{path.relative_to(ROOT)}:{line}" for line in
                  _stage_sniffing(ast.parse(path.read_text(encoding="utf-8")), names, sections)]
    assert wrong == []


def test_no_module_or_function_outgrows_its_guide():
    long_modules, long_functions = [], []
    for name, path in sources_of().items():
        if not name.startswith("rlkit"):
            continue
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert long_modules == [] and long_functions == []


def test_the_checks_see_a_circle_and_a_stage_import():
    """The helpers above find what they are for (a graph with a circle, an import by name, a
    recipe asked its stage)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
    assert _circles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []
    sources = sources_of()
    assert {"rlkit.run.driver", "rlkit.run.rundir"} <= imports_of("rlkit.grpo.run", sources["rlkit.grpo.run"],
                                                                set(sources))
    assert "rlkit.faults" in imports_of("rlkit.learner.actor", sources["rlkit.learner.actor"], set(sources))
    sniffing = ast.parse("if hasattr(cfg, 'rollout'): pass\nd = getattr(cfg, 'distill', None)\n"
                         "x = stage == 'sft' or name in ('grpo', 'other')\nhasattr(m, 'module'); v == 'x'")
    assert _stage_sniffing(sniffing, {"sft", "grpo"}, {"rollout", "distill"}) == [
        "1: hasattr(..., 'rollout')", "2: getattr(..., 'distill')", "3: compared with 'sft'",
        "3: compared with 'grpo'"]


def test_tests_share_helpers_through_helper_modules():
    """No test module imports another (what tests share lives in `tests/helpers.py` and the
    helper modules beside the tests that use them), and the checkout's root is defined once."""
    shared, roots = [], []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.") \
                    and node.module.rsplit(".", 1)[-1].startswith("test_"):
                shared.append(f"{path.relative_to(ROOT)} imports {node.module}")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROOT" for t in node.targets):
                roots.append(str(path.relative_to(ROOT)))
    assert shared == [] and roots == ["tests/helpers.py"]


def test_no_private_name_is_imported_from_another_package():
    """A name that starts with `_` is its package's own: another package that needs it gets it public."""
    sources, found = sources_of(), []
    for name, path in sources.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module in sources and unit(node.module) != unit(name):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_the_sandbox_is_a_component_of_its_own(graph):
    """`rlkit/sandbox/` walls untrusted code off for the code judge and the agent's commands alike: it
    needs nothing of rlkit but its errors, and the reward contract and the sandbox know nothing of
    each other; a command gets its walls through `walls.py`, not by taking bubblewrap's line apart."""
    sandbox = [m for m in graph if m.startswith("rlkit.sandbox.")]
    assert "rlkit.sandbox.walls" in sandbox
    outside = sorted(f"{m} -> {t}" for m in sandbox for t in graph[m]
                     if not t.startswith("rlkit.sandbox") and t != "rlkit.errors")
    crossing = sorted(f"{m} -> {t}" for m in graph for t in graph[m]
                      if {unit(m), unit(t)} == {"rlkit.reward", "rlkit.sandbox"})
    agent = sorted(t for t in graph["rlkit.agent.command"] if t.startswith("rlkit.sandbox"))
    assert outside == [] and crossing == [] and agent == ["rlkit.sandbox.pipes", "rlkit.sandbox.walls"]


def test_the_rollout_and_the_learner_sides_meet_only_where_they_cross(graph):
    """rlkit's central split in its layout: the vLLM rollout side (`rlkit/rollout/`) knows no learner
    and no crossing; what crosses (`rlkit/sync/`: the transports' two ends, an engine colocated in a
    learner) knows the engines but no learner; the DeepSpeed learner side (`rlkit/learner/`) reaches
    the engines only through it; the cluster's plumbing (`rlkit/actors/`) knows none of the three."""
    forbidden = {"rlkit.rollout": ("rlkit.learner", "rlkit.sync"), "rlkit.sync": ("rlkit.learner",),
                 "rlkit.learner": ("rlkit.rollout",), "rlkit.actors": ("rlkit.rollout", "rlkit.learner", "rlkit.sync")}
    wrong = sorted(f"{m} -> {t}" for m in graph for t in graph[m]
                   if unit(m) in forbidden and unit(t) in forbidden[unit(m)])
    crossing = {unit(t) for m in graph if unit(m) == "rlkit.learner" for t in graph[m]}
    assert wrong == [] and "rlkit.sync" in crossing
