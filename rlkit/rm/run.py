"""`rlkit rm`: a reward model trained on preference pairs, the loop `rlkit dpo` runs
(`rlkit.dpo.run.run_pairs`) with a one-score head and TRL's Bradley-Terry loss. Its final/ is a
sequence classifier of one label that `rewards.model:RewardModel` loads as it is."""

from __future__ import annotations

from pathlib import Path

from rlkit.dpo.run import PairStage, run_pairs
from rlkit.rm.config import RMConfig
from rlkit.rm.objective import RewardObjective, pair_means


def run_rm(cfg: RMConfig, recipe_path: str | Path | None = None) -> Path:
    """Run the reward model's training from a loaded recipe; returns the final model directory."""
    c = cfg.rm.center_rewards_coefficient
    return run_pairs(cfg, PairStage("rm", RewardObjective(c), pair_means, False, "score",
                                    "Bradley-Terry loss" + (f", center_rewards_coefficient {c}" if c else "")))
