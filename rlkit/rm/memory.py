"""The reward model's memory model: the learner ranks of a stage on pairs, without a reference
(its one score needs no vocabulary of logits either; they are counted as the lm_head's, an
over-estimate)."""

from __future__ import annotations

from rlkit.dpo.memory import pair_memory

MEMORY = pair_memory(reference=lambda cfg: False)
