"""`rlkit reward test`: a TRL-style reward module, a recipe, failures, bad input, --model."""

import argparse
import json
import sys

import pytest

from rlkit.commands import reward as reward_cli

TRL_STYLE = '''
def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

def fragile(completions, **kwargs):
    return [1.0 / len(c) for c in completions]
'''


def cli(*argv):
    p = argparse.ArgumentParser(prog="rlkit")
    reward_cli.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["reward", "test", *argv])
    return args.func(args)


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE)
    rows = [{"prompt": "12+7=", "completion": "19", "answer": "19"},
            {"prompt": "3+4=", "completion": "8", "answer": "7"},
            {"prompt": "答案？", "completion": "五", "answer": "五"}]
    (tmp_path / "samples.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # rlkit adds this folder to find my_rewards: not for later tests
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_trl_style_module_runs_unchanged(work, capsys):
    assert cli("my_rewards:exact", "--data", "samples.jsonl") == 0
    out = capsys.readouterr().out
    assert "rewards over 3 rows" in out
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith("exact"))
    assert "0.667" in row                              # mean of [1, 0, 1]
    for probe in ("empty completion", "repeated text (x8)", "answer repeated x50", "overlong (10k chars)"):
        assert probe in out
    assert "OK" in out


def test_recipe_rewards_with_args(work, capsys):
    (work / "recipe.yaml").write_text(
        "model: x\nrewards:\n"
        "  - {fn: 'my_rewards.py:exact', weight: 2.0}\n"
        "  - {fn: 'rewards.exact:number_match', args: {position: last}}\n"
        "  - {fn: 'rewards.format:reasoning_steps'}\n")
    assert cli("--data", "samples.jsonl", "--recipe", "recipe.yaml") == 0
    out = capsys.readouterr().out
    assert "number_match" in out and "reasoning_steps" in out


def test_probe_flags_a_hackable_reward(work, capsys):
    (work / "hack.py").write_text("def longer(completions, **kw):\n"
                                  "    return [min(1.0, len(c) / 10) for c in completions]\n")
    assert cli("hack.py:longer", "--data", "samples.jsonl") == 0
    out = capsys.readouterr().out
    assert "scores like real data" in out


NAIVE_CODE_REWARD = '''
import re, subprocess, sys

def naive(completions, test_cases, **kwargs):
    """Runs the code and then its asserts in one child process, judged by its exit status: the
    judge is inside the untrusted process, which is what the sandbox probes are for."""
    out = []
    for c, tests in zip(completions, test_cases):
        m = re.findall(r"```python\\n(.*?)```", c, re.S)
        program = (m[-1] if m else "raise SystemExit(1)") + "\\n" + "\\n".join(tests)
        try:
            ok = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=2).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        out.append(float(ok))
    return out

naive.rlkit_runs_code = True
'''


@pytest.mark.skipif(__import__("rlkit.sandbox.programs", fromlist=["x"]).namespaces_problem() is not None,
                    reason="no sandbox here")
def test_sandbox_probes_show_each_verdict(work, capsys):
    """For a reward that runs code, `reward test` plays what a policy might write instead of a
    solution: the shipped code reward contains every probe; one that judges in-process is forged."""
    rows = [{"prompt": "Write add.", "completion": "```python\ndef add(a, b):\n    return a + b\n```",
             "test_cases": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]},
            {"prompt": "Write add.", "completion": "```python\ndef add(a, b):\n    return a\n```",
             "test_cases": ["assert add(1, 2) == 3", "assert add(0, 2) == 2"]}]
    (work / "code.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (work / "naive.py").write_text(NAIVE_CODE_REWARD)
    assert cli("rewards.code:code_reward", "--data", "code.jsonl", "--arg", "timeout_s=1") == 0
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if "sandbox: " in line]
    assert len(verdicts) >= 8 and all("contained" in line for line in verdicts), verdicts
    assert cli("naive.py:naive", "--data", "code.jsonl") == 0
    out, err = capsys.readouterr()
    assert "fork-bomb probes are skipped" in err  # it declares no sandbox: the bombs would hit this machine
    forged = [line.split("│")[1].strip() for line in out.splitlines() if "forged: naive > 0" in line]
    assert "sandbox: object equal to anything" in forged, out
    rows[1]["test_cases"][1] = "assert eval('add(0, 2)') == 2"  # needs one namespace with the candidate
    (work / "code.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli("rewards.code:code_reward", "--data", "code.jsonl") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlkit reward test: code.jsonl: row 2: rewards[0] (code_reward) cannot judge it: test case "
        "\"assert eval('add(0, 2)') == 2\" calls eval(): the test runs apart from the candidate's code, with the "
        "standard library and the candidate's functions by name only"]
    rows[1]["test_cases"][1] = "assert pow(2, 3) == 8"  # never calls the candidate: any completion passes it
    (work / "code.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli("rewards.code:code_reward", "--data", "code.jsonl") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlkit reward test: code.jsonl: row 2: rewards[0] (code_reward) cannot judge it: test case "
        "'assert pow(2, 3) == 8' uses no name the candidate defines: the tests' side computes it alone, so every "
        "completion, however wrong, passes it; call the function under test in it, or remove it"]


def test_failing_call_exits_1_with_the_sample(work, capsys):
    (work / "samples.jsonl").write_text('{"prompt": "说点什么", "completion": ""}\n'
                                        '{"prompt": "p", "completion": "ok"}\n')
    assert cli("my_rewards:fragile", "--data", "samples.jsonl") == 1
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "说点什么" in out and "FAILED" in out


@pytest.mark.parametrize("argv, message", [
    (["my_rewards:exact", "--data", "missing.jsonl"], "missing.jsonl: file not found"),
    (["my_rewards:exactt", "--data", "samples.jsonl"], "has no function 'exactt' (did you mean 'exact'?)"),
    (["my_rewards:exact", "--data", "bad.jsonl"], "bad.jsonl: line 2: invalid JSON"),
    (["my_rewards:exact", "--data", "samples.jsonl", "--arg", "noequals"], "--arg 'noequals': expected key=value"),
    (["--data", "samples.jsonl"], "name a reward (module:function) or pass --recipe"),
    (["my_rewards:exact", "--data", "nocompl.jsonl"], "nocompl.jsonl: row 1: no `completion` (add it, or pass --model"),
    (["my_rewards:exact"], "--data: name the rows to score (or a --recipe whose data.train has them)"),
])
def test_bad_input_exits_2_with_one_line(work, capsys, argv, message):
    (work / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    (work / "nocompl.jsonl").write_text('{"prompt": "a"}\n')
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_generate_with_model(work, capsys, tiny_model):
    (work / "prompts.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n'
                                        '{"prompt": "hello", "answer": "world"}\n')
    assert cli("rewards.exact:exact_match", "--data", "prompts.jsonl", "--model", str(tiny_model),
               "--max-new-tokens", "4") == 0
    assert "exact_match" in capsys.readouterr().out


def test_new_rewards_on_chat_rows_with_probes(work, capsys, monkeypatch):
    """The rewards open-r1/TRL users look for, on Chinese chat rows, through `rlkit reward test`:
    each is scored and probed; the reasoning-only accuracy gives nothing to an answer that sits
    only in an unfinished <think> (the plain one gives full credit: what the probe is for)."""
    monkeypatch.setenv("COLUMNS", "300")
    rows = [{"prompt": [{"role": "user", "content": "三加四等于几？"}],
             "completion": "<think>三加四得七</think>\n答案是 \\boxed{7}", "answer": "7"},
            {"prompt": [{"role": "user", "content": "写一个函数"}],
             "completion": "<think>想想</think>\n```python\nprint(1)\n```", "answer": "1"}]
    (work / "chat.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    (work / "recipe.yaml").write_text(
        "model: x\nrewards:\n"
        "  - {fn: 'rewards.math:accuracy'}\n"
        "  - {fn: 'rewards.math:accuracy', name: after_think, args: {reasoning_delimiters: ['</think>']}}\n"
        "  - {fn: 'rewards.format:think_format'}\n"
        "  - {fn: 'rewards.format:code_format'}\n"
        "  - {fn: 'rewards.length:cosine_scaled', args: {max_len: 100}}\n"
        "  - {fn: 'rewards.repetition:repetition_penalty'}\n")
    assert cli("--data", "chat.jsonl", "--recipe", "recipe.yaml") == 0
    out = capsys.readouterr().out
    for name in ("accuracy", "after_think", "think_format", "code_format", "cosine_scaled", "repetition_penalty"):
        assert name in out, name
    probe = next(line for line in out.splitlines() if "only in unfinished <think>" in line)
    cells = [c.strip() for c in probe.split("│")]
    i = cells.index("answer only in unfinished <think>")
    assert cells[i + 2] == "1.000" and cells[i + 3] == "0.000", probe   # accuracy, after_think


def test_data_in_every_training_format(work, capsys):
    """--data reads what training reads: a .json list of alpaca rows, chat rows, a dataset_info.json
    entry, the recipe's own data.train; rows without a completion are scored on their response."""
    alpaca = [{"instruction": "计算", "input": "12+7", "output": "19"},
              {"instruction": "计算", "input": "3+4", "output": "7"}]
    (work / "alpaca.json").write_text(json.dumps(alpaca, ensure_ascii=False))
    chat = [{"messages": [{"role": "user", "content": "首都？"}, {"role": "assistant", "content": "北京"}]}]
    (work / "chat.json").write_text(json.dumps(chat, ensure_ascii=False))
    (work / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "alpaca.json"}}))
    (work / "recipe.yaml").write_text("model: x\ndata: {train: alpaca.json}\nrewards:\n"
                                      "  - {fn: 'rewards.exact:exact_match'}\n")
    for argv, rows in ((["rewards.exact:exact_match", "--data", "alpaca.json"], 2),
                       (["rewards.exact:exact_match", "--data", "chat.json"], 1),
                       (["rewards.exact:exact_match", "--data", "dataset_info.json", "--dataset", "mine"], 2),
                       (["--recipe", "recipe.yaml"], 2)):
        assert cli(*argv) == 0, argv
        captured = capsys.readouterr()
        assert f"rewards over {rows} rows" in captured.out, argv
        table = next(line for line in captured.out.splitlines() if line.strip("│ ").startswith("exact_match"))
        assert "1.000" in table, argv  # each row's own response matches its gold
        assert "no `completion` column: scoring each row's own response" in captured.err


def test_generate_renders_prompts_with_the_training_template(work, capsys, tiny_model, monkeypatch):
    """--model renders each prompt as a run renders it: data.template (auto: the chat template for
    chat rows; --template or the recipe's key names one)."""
    from rlkit.data import templates

    seen = []
    real = templates.render_prompt
    monkeypatch.setattr(templates, "render_prompt", lambda row, t, tok=None: seen.append(t) or real(row, t, tok))
    (work / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "1 + 1 ="}], "answer": "2"}\n')
    (work / "recipe.yaml").write_text("model: x\ndata: {train: chat.jsonl, template: alpaca}\nrewards:\n"
                                      "  - {fn: 'rewards.exact:exact_match'}\n")
    for argv, want in ((["rewards.exact:exact_match", "--data", "chat.jsonl"], "chat"),
                       (["rewards.exact:exact_match", "--data", "chat.jsonl", "--template", "alpaca"], "alpaca"),
                       (["--recipe", "recipe.yaml"], "alpaca")):
        seen.clear()
        assert cli(*argv, "--model", str(tiny_model), "--max-new-tokens", "2") == 0, capsys.readouterr().err
        assert seen == [want], argv
