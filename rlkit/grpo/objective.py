"""The GRPO objective the learners optimise: the clipped policy loss (+ KL) of `loss.py` on the
completion tokens of a micro-batch, built once from the recipe.

A micro-batch (`GRPOBatch.micro_batch`) holds input_ids, attention_mask, completion_mask,
advantages and `num_items_in_batch`; `old_logp` (the sampling engine's, in async mode, or the
policy's before the step's first update) and `ref_logp` (the frozen reference) when needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlkit.config import RolloutConfig
from rlkit.engine.logprobs import token_logprobs
from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.loss import policy_loss

METRICS = ("loss", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "kl_mean", "entropy")


@dataclass(frozen=True)
class GRPOObjective:
    temperature: float  # the sampling temperature: logprobs of logits / temperature, as vLLM's
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl: str
    loss_type: str
    max_completion_length: int
    needs: tuple[str, ...]  # logprobs the learner attaches before the first update

    @classmethod
    def from_config(cls, algo: GRPOAlgoConfig, rollout: RolloutConfig) -> GRPOObjective:
        """Reference logprobs when beta > 0. Old-policy logprobs: with async generation the engine's
        sampling logprobs (already in the batch); else recomputed by the learner when a rollout batch
        is reused (epochs > 1 or several mini-batches); else the ratio is taken against the detached
        policy (on-policy)."""
        reused = (algo.epochs > 1 or algo.mini_batches > 1) and not algo.async_generation
        needs = (("ref_logp",) if algo.beta > 0 else ()) + (("old_logp",) if reused else ())
        return cls(rollout.temperature, algo.epsilon_low, algo.epsilon_high, algo.beta, algo.kl, algo.loss_type,
                   rollout.max_tokens, needs)

    def __call__(self, model: Any, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logp, entropy = token_logprobs(model, batch, self.temperature, with_entropy=True)
        out = policy_loss(logp, batch.get("old_logp"), batch["advantages"], batch["completion_mask"][:, 1:].float(),
                          ref_logp=batch.get("ref_logp"), entropies=entropy, epsilon_low=self.epsilon_low,
                          epsilon_high=self.epsilon_high, beta=self.beta, kl=self.kl, loss_type=self.loss_type,
                          max_completion_length=self.max_completion_length,
                          num_items_in_batch=batch["num_items_in_batch"])
        return out.loss, {k: getattr(out, k).detach() for k in METRICS if getattr(out, k) is not None}
