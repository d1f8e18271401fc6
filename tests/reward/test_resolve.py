"""Resolution before a run: import by path, bind args, check columns; one-line errors naming the key."""


import pytest

from rlkit.reward import RewardError, RewardSpec, resolve
from tests.reward.conftest import MODULE, spec


def test_module_path_next_to_recipe(tmp_path, monkeypatch):
    d = tmp_path / "recipe_dir"
    d.mkdir()
    (d / "rlkit_test_rewards_mod_a.py").write_text(MODULE)
    r = resolve(RewardSpec(fn="rlkit_test_rewards_mod_a:exact"), base_dir=str(d), columns={"answer"})
    assert r.name == "exact"
    dotted = resolve(RewardSpec(fn="rlkit_test_rewards_mod_a.length"), base_dir=str(d))  # TRL's dotted form
    assert dotted.name == "length"


@pytest.mark.parametrize("fn, args, columns, message", [
    ("nope_mod_xyz:f", {}, None, r"^rewards\[0\]\.fn: 'nope_mod_xyz:f' — no module 'nope_mod_xyz'"),
    ("{f}:exactt", {}, None, r"has no function 'exactt' \(did you mean 'exact'\?\)"),
    ("{f}:NOT_CALLABLE", {}, None, r"'NOT_CALLABLE' is a int, not a function"),
    ("{f}:length", {"scael": 2}, None,
     r"rewards\[0\]\.args: 'scael' is not a parameter of length \(did you mean 'scale'\?\)"),
    ("{f}:needs_col", {}, {"answer"}, r"needs_col needs 'difficulty' — not a dataset column \(columns: answer\)"),
    ("{f}:Scaled", {}, None, r"rewards\[0\]\.args: Scaled\(\) — missing a required argument: 'factor'"),
    ("{f}:exact", {"answer": "x"}, {"answer"}, r"'answer' is also a dataset column"),
    ("missing.py:f", {}, None, r"file .*missing.py not found"),
    ("nocolon", {}, None, r"^fn: expected 'module.path:function', 'path/to/file.py:function' or TRL's"),
])
def test_resolve_errors_are_one_line_naming_the_key(mod, fn, args, columns, message):
    with pytest.raises(RewardError, match=message) as e:
        resolve(RewardSpec(fn=fn.format(f=mod / "my_rewards.py"), args=args), str(mod), columns)
    assert "\n" not in str(e.value)


def test_column_check_passes_when_column_or_arg_present(mod):
    resolve(spec(mod, "needs_col"), None, {"difficulty"})
    resolve(spec(mod, "needs_col", args={"difficulty": [1]}), None, set())


def test_import_failure_names_the_line(tmp_path):
    (tmp_path / "broken.py").write_text("x = 1\nundefined_name\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py failed: NameError: .* \(broken.py, line 2\)"):
        resolve(RewardSpec(fn=f"{tmp_path}/broken.py:f"), None, None, key="rewards[3]")
