"""Online difficulty for GRPO (the seeds' curriculum applied to RL; prime-rl's easy/hard pools).

A prompt whose last group was all solved (every reward >= `solved_at`) is "easy", one whose last
group was all failed (every reward <= `failed_at`) is "hard": neither gives a group-relative
advantage, so they cost generation and teach nothing. The curriculum sampler asks `accept` for
each row it draws; an easy or hard row is kept with probability `keep` and otherwise skipped
for this pass over its pool, so it is drawn about 1/keep times less often. A later group of the
row that is neither resets it. The level mix of the difficulty schedule is unchanged: skipping
happens inside a level's pool. The state (each row's status, the counters) is part of the
sampler's checkpoint state, so a resumed run draws the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

EASY, HARD = "easy", "hard"


class OnlineDifficulty:
    """Row filter of a `CurriculumSampler` (`accept`, `state_dict`, `load_state_dict`), fed with
    the rewards of every group the run scores (`observe`)."""

    def __init__(self, n_rows: int, keep: float, solved_at: float, failed_at: float):
        if not 0 < keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        self.n_rows, self.keep, self.solved_at, self.failed_at = n_rows, keep, solved_at, failed_at
        self.status: dict[int, str] = {}
        self.skipped = 0  # rows skipped while drawing, since the last `metrics`

    def observe(self, row: int, rewards: Sequence[float]) -> None:
        """The rewards of one group of `row` (NaN never counts as solved or failed)."""
        if rewards and all(r >= self.solved_at for r in rewards):
            self.status[row] = EASY
        elif rewards and all(r <= self.failed_at for r in rewards):
            self.status[row] = HARD
        else:
            self.status.pop(row, None)

    def accept(self, row: int, rng: random.Random) -> bool:
        """Whether the sampler keeps `row` now (draws from `rng` only for easy or hard rows)."""
        if row not in self.status or rng.random() < self.keep:
            return True
        self.skipped += 1
        return False

    def metrics(self) -> dict[str, float]:
        """Shares of rows now easy / hard, and rows skipped since the last call."""
        easy = sum(s == EASY for s in self.status.values())
        out = {"online_difficulty/easy_frac": easy / self.n_rows,
               "online_difficulty/hard_frac": (len(self.status) - easy) / self.n_rows,
               "online_difficulty/skipped": float(self.skipped)}
        self.skipped = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"status": {str(k): v for k, v in self.status.items()}, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.status = {int(k): v for k, v in state["status"].items()}
        self.skipped = int(state["skipped"])
