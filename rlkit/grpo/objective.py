"""The GRPO objective the learners optimise: the policy loss (+ KL) of `loss.py` on the completion
tokens of a micro-batch, weighted by the rollout correction of `correction.py`, built once from
the recipe.

A micro-batch (`GRPOBatch.micro_batch`, a `MicroBatch`) holds input_ids, attention_mask,
completion_mask, advantages, `num_items_in_batch` and `engine_logp` (the sampling engine's
logprobs); the learner attaches (`MicroBatch.attach`) `old_logp` (the policy before the step's
first update) when the batch is reused, and `ref_logp` (the frozen reference) when beta > 0.
Without `old_logp`, the policy before the update is the detached forward itself: every
micro-batch of the first optimizer step sees those weights.

On-policy distillation (a `DistillConfig`): with `loss: reverse_kl` the learner also attaches
`teacher_logp` and each token's advantage becomes coef x (log p_teacher - log p_student) +
reward_weight x the group advantage; with `loss: jsd` the objective asks the learner for the
teacher itself (`uses`) and adds coef x TRL's generalized JSD over the vocabulary to
reward_weight x the policy loss (the policy loss is skipped at reward_weight 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlkit.distill.loss import generalized_jsd, reverse_kl_advantages
from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.correction import off_policy_mask, rollout_correction
from rlkit.grpo.loss import SoftGates, policy_loss
from rlkit.learner.logprobs import completion_states, token_logprobs
from rlkit.rollout.config import RolloutConfig

METRICS = ("loss", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "kl_mean", "entropy", "phi_mean")


@dataclass(frozen=True)
class GRPOObjective:
    temperature: float  # the sampling temperature: logprobs of logits / temperature, as vLLM's
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl: str
    loss_type: str
    importance_sampling_level: str
    max_completion_length: int
    correction: str
    clip_min: float | None
    clip_max: float | None
    off_policy_threshold: float | None
    gates: SoftGates
    needs: tuple[str, ...]  # logprobs the learner attaches before the first update
    distill_coef: float = 0.0  # on-policy distillation: weight of log p_teacher - log p_student per token
    reward_weight: float = 1.0  # weight of the rewards' group advantage (jsd: of the policy loss)
    distill_loss: str = "reverse_kl"  # reverse_kl: the teacher's logprobs as advantage; jsd: over the vocabulary
    distill_beta: float = 1.0  # jsd: 0 forward KL, 1 reverse KL
    uses: tuple[str, ...] = ()  # frozen models the learner passes to each call, by keyword ("teacher" for jsd)
    bias_correction_kl: bool = False  # the KL term times the ratio (TRL's use_bias_correction_kl)

    @classmethod
    def from_config(cls, algo: GRPOAlgoConfig, rollout: RolloutConfig, distill: Any = None) -> GRPOObjective:
        """Reference logprobs when beta > 0; the old policy's when a rollout batch is reused
        (epochs > 1 or several mini-batches), else the ratio is taken against the detached policy;
        the teacher's with `distill` (a `DistillConfig`)."""
        reused = algo.epochs > 1 or algo.mini_batches > 1
        jsd = distill is not None and distill.loss == "jsd"
        policy = not jsd or distill.reward_weight > 0  # the policy loss (and what it needs) is computed
        needs = (("ref_logp",) if algo.beta > 0 and policy else ()) + (("old_logp",) if reused and policy else ()) + \
            (("teacher_logp",) if distill is not None and not jsd and distill.coef > 0 and
             distill.placement == "learner" else ())  # placement actor: the teacher's actor attaches them
        gates = SoftGates(**{f.name: getattr(algo, f.name) for f in dataclasses.fields(SoftGates)})
        opd = {} if distill is None else dict(
            distill_coef=distill.coef, reward_weight=distill.reward_weight, distill_loss=distill.loss,
            distill_beta=distill.beta, uses=("teacher",) if jsd and distill.coef > 0 else ())
        return cls(temperature=rollout.temperature, epsilon_low=algo.epsilon_low, epsilon_high=algo.epsilon_high,
                   beta=algo.beta, kl=algo.kl, loss_type=algo.loss_type,
                   importance_sampling_level=algo.importance_sampling_level, max_completion_length=rollout.max_tokens,
                   correction=algo.rollout_correction, clip_min=algo.correction_clip_min,
                   clip_max=algo.correction_clip_max, off_policy_threshold=algo.off_policy_mask_threshold,
                   gates=gates, needs=needs, bias_correction_kl=algo.use_bias_correction_kl, **opd)

    def positions(self, batch: dict[str, Tensor]) -> Tensor:
        """The completion tokens (shifted space): the only logprobs the loss reads."""
        return batch["completion_mask"][:, 1:].bool()

    def __call__(self, model: Any, batch: dict[str, Tensor], teacher: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        metrics: dict[str, Tensor] = {}
        jsd = None
        if "teacher" in self.uses:
            if teacher is None:
                raise RuntimeError("distill.loss: jsd needs the teacher model in the objective's call")
            jsd = self._jsd(model, teacher, batch, metrics)
            if self.reward_weight == 0:
                metrics["loss"] = jsd.detach()
                return self.distill_coef * jsd, metrics
        logp, entropy = token_logprobs(model, batch, self.temperature, with_entropy=True,
                                       positions=self.positions(batch))
        mask = batch["completion_mask"][:, 1:].float()
        old, engine = batch.get("old_logp"), batch.get("engine_logp")
        before = logp.detach() if old is None else old  # the policy before this step's updates
        sampler = engine if engine is not None else before  # the policy that sampled the tokens
        weights = keep = None
        if engine is not None:
            corr = rollout_correction(before, engine, mask, self.correction, self.clip_min, self.clip_max)
            weights = corr.weights
            metrics.update(corr.metrics)
        advantages = batch["advantages"]
        teacher_logp = batch.get("teacher_logp")
        if teacher_logp is not None:  # on-policy distillation: the teacher's per-token signal is the advantage
            reverse = reverse_kl_advantages(sampler, teacher_logp, mask)
            advantages = self.reward_weight * advantages[:, None] + self.distill_coef * reverse
            metrics["distill/reverse_kl"] = -(reverse * mask).sum() / mask.sum().clamp(min=1)
        if self.off_policy_threshold is not None:
            keep = off_policy_mask(advantages, logp, sampler, mask, self.off_policy_threshold)
            metrics["off_policy/masked_frac"] = 1 - keep.mean()
        out = policy_loss(logp, old, advantages, mask, ref_logp=batch.get("ref_logp"), entropies=entropy,
                          epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=self.beta, kl=self.kl,
                          loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                          max_completion_length=self.max_completion_length,
                          num_items_in_batch=batch["num_items_in_batch"], is_weights=weights, keep=keep,
                          gates=self.gates, bias_correction_kl=self.bias_correction_kl)
        metrics.update({k: getattr(out, k).detach() for k in METRICS if getattr(out, k) is not None})
        if jsd is None:
            return out.loss, metrics
        return self.reward_weight * out.loss + self.distill_coef * jsd, metrics

    def _jsd(self, model: Any, teacher: Any, batch: dict[str, Tensor], metrics: dict[str, Tensor]) -> Tensor:
        """TRL's generalized JSD between student and teacher at the completion positions (the
        student's and the teacher's lm_heads project one chunk of positions at a time)."""
        import torch

        where, items = self.positions(batch), batch["num_items_in_batch"].to(torch.float32)
        student_states, student_head = completion_states(model, batch, where)
        with torch.no_grad():
            teacher_states, teacher_head = completion_states(teacher, batch, where)
        ones = where.new_ones((1, student_states.shape[0]))
        loss, entropy, n = generalized_jsd(student_states[None], teacher_states[None], student_head, teacher_head,
                                           ones, beta=self.distill_beta, temperature=self.temperature,
                                           num_items_in_batch=items,
                                           vocab=min(student_head.out_features, teacher_head.out_features))
        count = n.clamp(min=1)
        metrics["distill/jsd"] = loss.detach() * items / count  # per position
        metrics["entropy"] = entropy / count
        return loss
