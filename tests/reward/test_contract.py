"""The reward contract: spec validation; the reward layer imports no Ray/vLLM."""

import subprocess
import sys
import textwrap

import pytest

from rlkit.reward import RewardError, RewardSpec


def test_spec_validation():
    with pytest.raises(RewardError, match="on_error: expected"):
        RewardSpec(fn="a:b", on_error={"defualt": 0})
    with pytest.raises(RewardError, match="weight: expected a finite number"):
        RewardSpec(fn="a:b", weight=float("nan"))


def test_core_modules_do_not_import_ray_or_vllm():
    code = textwrap.dedent("""
        import sys
        import rlkit.reward, rlkit.reward_cli
        import rewards.math, rewards.format, rewards.length, rewards.exact, rewards.code, rewards.model
        bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'deepspeed', 'torch')]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
