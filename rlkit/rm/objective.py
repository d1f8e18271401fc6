"""The reward model's objective: one score per row from a one-label sequence classifier (the
`score` head on the model's last token that is not padding), chosen and rejected rows in one
forward, and TRL's Bradley-Terry loss on the pairs (`rlkit.dpo.loss.reward_loss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlkit.dpo.loss import reward_loss

PAIR_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


@dataclass(frozen=True)
class RewardObjective:
    """TRL's `RewardTrainer` loss of a micro-batch of pairs (`preference_batch`'s layout, with a
    `margin` per pair where the data has one); metrics summed over the pairs: `accuracy` (chosen
    scored above rejected), `margin`, each side's mean score, `loss` (times the pairs) and `pairs`."""

    center_rewards_coefficient: float | None = None
    temperature: float = 1.0
    needs: tuple[str, ...] = ()

    def positions(self, batch: Any) -> Tensor:
        return batch["completion_mask"][:, 1:] != 0

    def __call__(self, model: Any, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits[:, 0].float()
        chosen, rejected = scores.chunk(2)
        margin = batch["margin"].to(scores.dtype) if "margin" in batch else None
        loss, metrics = reward_loss(chosen, rejected, margin, self.center_rewards_coefficient)
        pairs = chosen.shape[0]
        return loss, {"loss": loss.detach() * pairs, "accuracy": metrics["accuracy"] * pairs,
                      "margin": metrics["margin"] * pairs, "rewards/chosen": chosen.detach().sum(),
                      "rewards/rejected": rejected.detach().sum(), "pairs": pairs}


def pair_means(sums: dict[str, float]) -> dict[str, float]:
    pairs = max(sums.get("pairs", 0), 1)
    return {"loss": sums["loss"] / pairs, **{k: sums[k] / pairs for k in PAIR_METRICS}}
