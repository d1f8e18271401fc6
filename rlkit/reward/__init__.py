"""Rewards: the TRL-compatible contract, resolution from a recipe, concurrent scoring.

- ``contract``: ``RewardSpec`` (one recipe entry), ``RewardError``, ``RewardResult``.
- ``resolve``: import ``module:function`` / ``file.py:function`` and check it before a run.
- ``score``: ``RewardScorer`` runs every function on a batch concurrently, weighted sum.

No Ray, DeepSpeed or vLLM imports here.
"""

from rlkit.reward.contract import (
    Failed,
    RewardError,
    RewardResult,
    RewardSpec,
    completion_text,
    prompt_text,
)
from rlkit.reward.resolve import ResolvedReward, resolve
from rlkit.reward.score import RewardScorer

__all__ = [
    "Failed", "RewardError", "RewardResult", "RewardScorer", "RewardSpec", "ResolvedReward",
    "completion_text", "prompt_text", "resolve",
]
