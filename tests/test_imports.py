"""The heavy stack imports together in one process (no CUDA torchvision breaking peft/trl)."""

import subprocess
import sys


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
