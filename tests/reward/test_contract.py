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
        import rlkit.reward, rlkit.commands.reward
        import rewards.math, rewards.format, rewards.length, rewards.exact, rewards.code, rewards.model
        bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'deepspeed', 'torch')]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_shipped_reward_declares_its_range():
    """rlkit checks each value a reward returns against the range it declares; the shipped ones do."""
    import importlib
    import inspect

    from rlkit.reward.contract import declared_range

    found = 0
    for name in ("code", "exact", "format", "length", "math", "model", "repetition"):
        module = importlib.import_module(f"rewards.{name}")
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) and "__call__" not in vars(obj) or not callable(obj):
                continue
            params = inspect.signature(obj.__call__ if inspect.isclass(obj) else obj).parameters
            if "completions" not in params:
                continue  # a helper, not a reward
            found += 1
            args = {"max_len": 100, "buffer_len": 10} if attr == "soft_overlong" else {}
            low, high = declared_range(obj, args)
            assert low is None or high is None or low <= high, attr
    assert found >= 17
