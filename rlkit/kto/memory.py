"""KTO's memory model: the learner ranks of a stage on pairs (`rlkit.dpo.memory.pair_memory`): a
micro-batch's rows and as many KL rows are the two sides' rows of a pair, and under full
fine-tuning the reference's frozen copy."""

from __future__ import annotations

from rlkit.dpo.memory import pair_memory

MEMORY = pair_memory(reference=lambda cfg: True)
