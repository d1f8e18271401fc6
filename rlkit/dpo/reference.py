"""A DPO run's reference beyond the one the learners score in the step: its sequence logprobs
computed once before training (TRL's `precompute_ref_log_probs`), and a reference that follows the
policy (TR-DPO's `sync_ref_model`: the learners move their frozen copy, `Learner.mix_reference`).

Computed once, the reference is the starting policy itself under full fine-tuning (the learners
then hold no frozen copy) and the policy with its adapters disabled under LoRA / QLoRA. The values
travel with every checkpoint, so a resumed run trains against the same numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlkit.dpo.loss import sequence_logps

PER_CALL = 32  # micro-batches a rank scores per call (a large set crosses to the learners in parts)

if TYPE_CHECKING:
    from rlkit.learner.group import LearnerGroup
    from rlkit.learner.objective import MicroBatch


@dataclass(frozen=True)
class ReferenceOnce:
    """The reference's logprobs of every pair, computed before the first step by the learners'
    `model` ("policy": the starting policy; "reference": adapters disabled), `ld_alpha` as the
    loss weighs the tokens."""

    model: str
    ld_alpha: float | None = None

    def attach(self, learners: LearnerGroup, data: Any, objective: Any,
               batches: Callable[[Sequence[dict]], list[MicroBatch]], saved: dict[str, Any] | None) -> Any:
        """`data` (a `PairData`) whose pairs carry `ref_chosen` and `ref_rejected`, with what a
        checkpoint keeps of them as its `kept` (`saved`: a resumed run's, used as they are);
        `batches` splits pairs into micro-batches."""
        from rlkit.errors import UserError

        if saved is None:
            saved = {split: self.score(learners, batches(pairs), len(pairs), objective)
                     for split, pairs in (("train", data.train), ("eval", data.eval)) if pairs}
        for split, pairs in (("train", data.train), ("eval", data.eval)):
            if pairs and len(saved.get(split, ())) != len(pairs):
                raise UserError(f"the checkpoint holds the reference's logprobs of {len(saved.get(split, ()))} "
                                f"{split} pairs, the data now has {len(pairs)}: resume with the data it was written "
                                "with, or start again with checkpoint.resume: never", "checkpoint.resume")
        return dataclasses.replace(data, train=with_reference(data.train, saved.get("train")),
                                   eval=with_reference(data.eval, saved.get("eval")), kept={"reference": saved})

    def score(self, learners: LearnerGroup, batches: list[MicroBatch], pairs: int, objective: Any) -> torch.Tensor:
        """[pairs, 2]: each pair's (chosen, rejected) sequence logprob under the reference, from its
        micro-batches in order."""
        starts = list(itertools.accumulate((mb["completion_mask"].shape[0] // 2 for mb in batches), initial=0))
        world, out = learners.size, torch.zeros(pairs, 2)
        for a in range(0, len(batches), world * PER_CALL):
            part = batches[a:a + world * PER_CALL]
            even = part + part[:1] * (-len(part) % world)  # as many forwards on every rank (ZeRO-3)
            scored = learners.logprobs([even[r::world] for r in range(world)], self.model, objective.positions)
            for r, per_batch in enumerate(scored):
                for j, logp in enumerate(per_batch):
                    if (i := a + r + j * world) < a + len(part):  # not a rank's evening repeat
                        sides = sequence_logps(logp * objective.positions(batches[i]), batches[i]["completion_mask"],
                                               self.ld_alpha).chunk(2)
                        out[starts[i]:starts[i + 1]] = torch.stack(sides, 1)
        return out


def with_reference(pairs: list[dict], logps: torch.Tensor | None) -> list[dict]:
    """The pairs with their reference logprobs (`logps` [N, 2]: chosen, rejected) attached."""
    if logps is None:
        return pairs
    return [{**p, "ref_chosen": c, "ref_rejected": r} for p, (c, r) in zip(pairs, logps.tolist(), strict=True)]
