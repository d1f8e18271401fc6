"""The pieces the GRPO driver composes: checked inputs, actors, and one method per loop stage."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from rlkit.checkpoint import CheckpointManager, resolve_resume
from rlkit.config import GRPOConfig
from rlkit.recipe import to_dict

log = logging.getLogger("rlkit")


class GRPORun:
    """State of one GRPO run; the driver in `run.py` calls these in loop order."""

    def __init__(self, cfg: GRPOConfig, recipe_path: str | Path | None):
        from rlkit.accel import detect
        from rlkit.data.curriculum import CurriculumSampler
        from rlkit.data.formats import load_prompts
        from rlkit.data.templates import render_prompt
        from rlkit.models import load_tokenizer
        from rlkit.reward import RewardScorer, RewardSpec
        from rlkit.sft.run import prepare_inputs

        self.cfg, g = cfg, cfg.grpo
        self.device = detect(cfg.device)
        prepare_inputs(cfg)  # model path checked; tiny model / synthetic data built where asked
        self.tokenizer = load_tokenizer(cfg.model)
        self.prompts = load_prompts(cfg.data.train, cfg.data.format, cfg.data.dataset, cfg.data.skip_bad_rows).rows
        self.eval_prompts = load_prompts(cfg.data.eval, cfg.data.format, cfg.data.dataset).rows if cfg.data.eval else []
        self.render = lambda row: render_prompt(row, cfg.data.template, self.tokenizer)
        base_dir = str(Path(recipe_path).resolve().parent) if recipe_path else None
        self.scorer = RewardScorer([RewardSpec(**asdict(r)) for r in cfg.rewards], base_dir,
                                   columns=set(self.prompts[0]) if self.prompts else None)
        self.total_steps = g.steps
        self.sampler = CurriculumSampler([r.get("difficulty") for r in self.prompts], g.steps, g.prompts_per_step,
                                         cfg.seed, cfg.curriculum.levels, [(p.until, p.mix) for p in cfg.curriculum.phases],
                                         cfg.curriculum.enabled)
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump({"stage": "grpo", **to_dict(cfg)}, sort_keys=False, allow_unicode=True), encoding="utf-8")
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.resume_from = resolve_resume(self.ckpts, cfg.checkpoint.resume)
        rows = g.prompts_per_step * g.group_size
        self.grad_accum = rows // g.mini_batches // g.num_learners // g.micro_batch_size
        self.learners = self.engines = None
        self.started_ray = False
        self.sync_strategy = sync_strategy(cfg, self.device)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        from rlkit.engine.group import LearnerGroup, start_ray
        from rlkit.engine.learner import LearnerSpec
        from rlkit.grpo.experience import RolloutGroup

        cfg, g = self.cfg, self.cfg.grpo
        self.started_ray = start_ray(cfg.ray, self.device)
        spec = LearnerSpec(cfg.model, cfg.finetuning, cfg.lora, cfg.qlora, cfg.optim, cfg.deepspeed,
                           g.micro_batch_size, self.grad_accum, g.steps * g.epochs * g.mini_batches, cfg.seed, cfg.device)
        self.learners = LearnerGroup(spec, g.num_learners, self.device, cfg.ray)
        if g.beta > 0:
            self.learners.call("build_reference")
        if cfg.rollout.colocate:
            self.engines = RolloutGroup.colocated(self.learners, cfg, cfg.model.path, self.device)
        else:
            self.engines = RolloutGroup(cfg, cfg.model.path, self.device)

    def resume(self) -> int:
        if self.resume_from is None:
            return 0
        self.learners.call("load_checkpoint", str(self.resume_from))
        saved = CheckpointManager.load_state(self.resume_from)
        self.sampler.load_state_dict(saved["sampler"])
        self.sync()  # engines start from model.path: give them the resumed policy
        log.warning("resumed from %s (step %d)", self.resume_from, saved["step"])
        return saved["step"]

    def logger(self, step: int) -> Any:
        from rlkit.metrics import MetricsLogger

        return MetricsLogger(self.run_dir, self.cfg.logging, self.total_steps, start_step=step,
                             config=to_dict(self.cfg), name="grpo")

    def shutdown(self) -> None:
        for part in (self.engines, self.learners):
            if part is not None:
                part.shutdown()
        self.scorer.close()
        if self.started_ray:
            import ray

            ray.shutdown()

    # ------------------------------------------------------------------ loop stages

    def launch(self, step: int) -> Any:
        """Draw the step's prompts and start generating (returns at once)."""
        from rlkit.grpo.experience import launch

        state = self.sampler.state_dict()
        rows = [self.prompts[i] for i in self.sampler.next_batch()]
        return launch(rows, self.render, self.engines, self.cfg, step, sampler_state=state)

    def finish(self, pending: Any, step: int) -> Any:
        """Wait for the generation, score it, refill (dynamic sampling): the step's experience."""
        from rlkit.grpo.experience import finish

        more = lambda: [self.prompts[i] for i in self.sampler.next_batch()]  # noqa: E731
        exp = finish(pending, more, self.render, self.engines, self.scorer, self.cfg, step)
        self.engines.idle()
        return exp

    def batch(self, exp: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        from rlkit.grpo.batch import collate
        from rlkit.grpo.experience import advantages

        adv = advantages(exp.rewards, self.cfg)
        batch = collate(exp.rollouts, adv, self.tokenizer.pad_token_id, self.cfg.grpo.mask_truncated,
                        behaviour_logp=self.cfg.grpo.async_generation)
        return batch, {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()),
                       "advantage/abs_mean": float(adv.abs().mean())}

    def plan(self, batch: dict[str, torch.Tensor], step: int) -> list[list[list[dict[str, torch.Tensor]]]]:
        """Micro-batch tensors per [mini-batch][rank]."""
        from rlkit.grpo.batch import plan_micro_batches, slice_batch

        g = self.cfg.grpo
        index = plan_micro_batches(len(batch["advantages"]), g.mini_batches, g.num_learners, g.micro_batch_size,
                                   self.cfg.seed + step)
        return [[[slice_batch(batch, mb) for mb in rank] for rank in mini] for mini in index]

    def attach_logprobs(self, batch: dict[str, torch.Tensor], plan: list) -> None:
        """Reference logprobs when beta > 0. Old-policy logprobs: with async generation the engine's
        sampling logprobs (already in the batch); else recomputed when a rollout batch is reused
        (epochs > 1 or several mini-batches); else the ratio is taken against the detached policy."""
        g, temp = self.cfg.grpo, self.cfg.rollout.temperature
        reused = (g.epochs > 1 or g.mini_batches > 1) and not g.async_generation
        wanted = (["ref"] if g.beta > 0 else []) + (["policy"] if reused else [])
        for which in wanted:
            key = "ref_logp" if which == "ref" else "old_logp"
            for mini in plan:
                results = self.learners.call_each("rollout_logprobs", [(rank, temp, which) for rank in mini])
                for rank, logps in zip(mini, results):
                    for mb, lp in zip(rank, logps):
                        mb[key] = lp

    def train(self, batch: dict[str, torch.Tensor], plan: list) -> dict[str, float]:
        from rlkit.grpo.batch import completion_tokens

        g = self.cfg.grpo
        loss_args = dict(epsilon_low=g.epsilon_low, epsilon_high=g.epsilon_high, beta=g.beta, kl=g.kl,
                         loss_type=g.loss_type, max_completion_length=self.cfg.rollout.max_tokens)
        # DeepSpeed averages over ranks and divides by grad_accum: this makes DAPO's normaliser
        # the completion-token count of the whole mini-batch.
        mini_args = [{**loss_args, "num_items_in_batch": max(completion_tokens(mb for rank in mini for mb in rank), 1)
                      / (g.num_learners * self.grad_accum)} for mini in plan]
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(g.epochs):
            for mini, args in zip(plan, mini_args):
                results = self.learners.call_each("grpo_step", [(rank, self.cfg.rollout.temperature, args)
                                                                for rank in mini])
                for r in results:
                    for k, v in r.items():
                        totals[k] = totals.get(k, 0.0) + v / len(results)
                updates += 1
        return {(k if k in ("lr", "grad_norm") else f"train/{k}"): v / updates for k, v in totals.items()}

    def sync(self) -> dict[str, float]:
        """Learner weights into the engines: in-process (colocated), object store or broadcast."""
        if self.sync_strategy == "in_process":
            return self.learners.call("push_weights_local")[0]
        return self.learners.call("push_weights", self.engines.engines, self.cfg.rollout.sync_bucket_mb,
                                  self.sync_strategy)[0]

    def evaluate(self) -> dict[str, float]:
        """Held-out prompts, `eval.samples_per_prompt` seeded samples each at `eval.temperature`:
        `eval_reward` (mean total reward) and `eval/<fn>` (mean of each reward function, e.g.
        exact-answer accuracy)."""
        from rlkit.grpo.experience import score_rows

        rows, n = self.eval_prompts, self.cfg.eval.samples_per_prompt
        prompts = [self.render(r) for r in rows]
        samples = self.engines.generate(prompts, n, seed=10**6, cfg=self.cfg, temperature=self.cfg.eval.temperature)
        result = score_rows(self.scorer, rows, prompts, samples, n)
        self.engines.idle()
        means = result.metrics("eval")  # means over non-None values, NaN where a function gave none
        return {"eval_reward": means["eval/mean"], **{f"eval/{name}": means[f"eval/{name}/mean"] for name in result.per_fn}}

    def checkpoint(self, step: int, pending: Any = None) -> None:
        """Learner state after `step`; the sampler as it was before the next step's prompts were
        drawn (with async generation they already are)."""
        staging = self.ckpts.staging_dir(step)
        self.learners.call("save_checkpoint", str(staging))
        sampler = pending.sampler_state if pending is not None else self.sampler.state_dict()
        self.ckpts.commit(staging, step, {"sampler": sampler, "driver": {}})

    def save_final(self) -> Path:
        final = self.run_dir / "final"
        self.learners.call("save_model", str(final), self.cfg.model.tokenizer or self.cfg.model.path)
        return final


def sync_strategy(cfg: GRPOConfig, device: Any) -> str:
    """The weight-sync strategy `rollout.sync` resolves to on `device`; a user error if it cannot run."""
    from rlkit.errors import UserError

    sync = cfg.rollout.sync
    if sync == "auto":
        return "in_process" if cfg.rollout.colocate else "object_store"
    if sync == "broadcast" and device.weight_sync_backend is None:
        raise UserError(f"rollout.sync: broadcast needs NCCL/HCCL between devices, but rlkit runs on "
                        f"{device.kind}; use sync: object_store (or auto)")
    return sync


def build_run(cfg: GRPOConfig, recipe_path: str | Path | None) -> GRPORun:
    return GRPORun(cfg, recipe_path)

