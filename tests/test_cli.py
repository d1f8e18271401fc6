"""The CLI lists only working commands; bad data and bad paths are one line + exit 2."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rlkit(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_lists_the_working_commands():
    out = _rlkit("--help")
    assert out.returncode == 0
    for cmd in ("sft", "grpo", "tiny-model", "demo", "merge", "reward"):
        assert f"    {cmd}" in out.stdout, cmd


def test_bad_row_names_file_row_and_field(tmp_path, tiny_model):
    data = tmp_path / "train.jsonl"
    rows = [{"instruction": "计算", "input": "1+1=", "output": "2"},
            {"instruction": "计算", "input": "2+2=", "output": ""}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = _rlkit("sft", "recipes/tiny-sft.yaml", f"model.path={tiny_model}", "model.build_tiny_if_missing=null",
                 f"data.train={data}", "data.eval=null", "eval.every=0", "data.build_synthetic_if_missing=null",
                 f"output_dir={tmp_path / 'o'}")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.jsonl: row 2: field 'output' is empty" in lines[0]
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_tiny_model_command(tmp_path):
    out = _rlkit("tiny-model", str(tmp_path / "m"), "--data", str(tmp_path / "d"))
    assert out.returncode == 0 and (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "d" / "grpo_train.jsonl").exists() and "written to" in out.stdout


def test_merge_rejects_non_adapter(tmp_path):
    out = _rlkit("merge", str(tmp_path), "--base", str(tmp_path), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "not a peft adapter directory" in out.stderr


def test_recipe_for_another_device_fails_before_launch(tmp_path):
    """The seed-004 recipe asks for CUDA: on a CPU host that is one line and exit 2."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("host has CUDA")
    out = _rlkit("sft", "recipes/llama7b-zero3-offload.yaml", f"output_dir={tmp_path / 'o'}")
    assert out.returncode == 2 and out.stderr.strip() == (
        "rlkit: error: device: the recipe asks for 'cuda' but this host has 'cpu' "
        "(set device: auto, or run it where that device is)")
