"""`rlkit grpo`: the driver. It holds prompts, the sampler and the reward functions, no weights.

Each step: sample prompts -> vLLM engines generate G completions each -> rewards -> group
advantages -> one typed batch, sent once to the learners, which score reference / old-policy
logprobs and train -> weights sync into the engines -> metrics and an atomic checkpoint.

With `grpo.async_generation` the engines generate step k+1 while the learners train step k
(the batch is one policy version old; the engine's sampling logprobs are the ratio's
denominator). Ray runs an engine's calls in order, so the weight sync after step k waits for
that generation to finish and never lands mid-generation.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from rlkit.driver import RunDir, curriculum_sampler, learner_group, learner_spec, prepare_inputs
from rlkit.engine.objective import mean_metrics
from rlkit.grpo.batch import GRPOBatch, plan_micro_batches
from rlkit.grpo.config import GRPOConfig
from rlkit.grpo.experience import Generation, advantages, collect, evaluate, start_generation
from rlkit.grpo.objective import GRPOObjective
from rlkit.grpo.task import Task, load_task, recipe_dir
from rlkit.seeding import derive_seed


def run_grpo(cfg: GRPOConfig, recipe_path: str | Path | None = None) -> Path:
    """Run GRPO from a loaded recipe; returns the final policy directory. Everything a user can
    get wrong (model path, data, rewards, sync strategy) is checked before Ray starts."""
    from rlkit.accel import detect
    from rlkit.engine.engines import start_engines, sync_strategy

    g = cfg.grpo
    device = detect(cfg.device)
    sync_strategy(cfg.rollout, device)
    prepare_inputs(cfg.model, cfg.data)
    task = load_task(cfg.model, cfg.data, cfg.rewards, g.reward_default, recipe_dir(recipe_path))
    with closing(task.scorer):
        sampler = curriculum_sampler(cfg.curriculum, task.difficulties, g.steps, g.prompts_per_step, cfg.seed,
                                     cfg.data.train)
        run = RunDir(cfg, "grpo")
        spec = learner_spec(cfg, g.micro_batch_size, g.grad_accum, g.steps * g.epochs * g.mini_batches,
                            reference=g.beta > 0)
        with learner_group(cfg, spec, g.num_learners, device) as learners:
            engines = start_engines(cfg.rollout, cfg.model, device, cfg.ray, learners, cfg.seed)
            try:
                step, _ = run.resume(learners, sampler)
                if step:
                    engines.sync_from(learners)  # engines start from model.path: give them the resumed policy
                with closing(run.logger(cfg.logging, g.steps, step)) as logger:
                    _train(cfg, task, sampler, run, learners, engines, logger, step)
                return learners.save_model(run.final, cfg.model.tokenizer or cfg.model.path)
            finally:
                engines.shutdown()


def _train(cfg: GRPOConfig, task: Task, sampler: Any, run: RunDir, learners: Any, engines: Any, logger: Any,
           step: int) -> None:
    """The loop, from `step` to `grpo.steps`."""
    from rlkit.engine.engines import sampling

    g, total, objective = cfg.grpo, cfg.grpo.steps, GRPOObjective.from_config(cfg.grpo, cfg.rollout)
    sample = sampling(cfg.rollout)

    def start(at: int, attempt: int = 0) -> Generation:  # draw the step's prompts, start generating
        state = sampler.state_dict() if attempt == 0 else None
        rows = [task.rows[i] for i in sampler.next_batch()]
        return start_generation(rows, task, engines, sample, g.group_size,
                                derive_seed(cfg.seed, "generate", at, attempt), state)

    def held_out() -> dict[str, float]:
        eval_sampling = sample if cfg.eval.temperature is None else dataclasses.replace(
            sample, temperature=cfg.eval.temperature)
        return evaluate(task, engines, eval_sampling, cfg.eval.samples_per_prompt, derive_seed(cfg.seed, "eval"))

    if step == 0 and task.eval_rows:
        logger.log(0, held_out())                                                 # the starting point
    pending = start(step) if step < total else None
    while step < total:
        t0 = time.perf_counter()
        exp = collect(pending, functools.partial(start, step), task.scorer, g, cfg.rollout.max_tokens)
        engines.idle()                                                            # generate, score (+ refills)
        adv, adv_metrics = advantages(exp.rewards, g)
        batch = GRPOBatch.collate(exp.rollouts, adv, task.pad_id, g.mask_truncated, g.async_generation)
        pending = start(step + 1) if g.async_generation and step + 1 < total else None
        t1 = time.perf_counter()                                                  # ^ generates during training
        plan = plan_micro_batches(len(batch), g.mini_batches, g.num_learners, g.micro_batch_size,
                                  derive_seed(cfg.seed, "plan", step))
        fits = learners.fit(batch.shards(plan), objective, g.epochs)             # ref/old logprobs, PG loss + KL
        t2 = time.perf_counter()
        sync = engines.sync_from(learners)                                        # learner -> vLLM, no restart
        step += 1
        metrics = {**exp.metrics, "reward": exp.metrics["reward/mean"], **adv_metrics,
                   **_step_metrics(fits, len(exp.rollouts), sync, t0, t1, t2)}
        if task.eval_rows and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total):
            metrics.update(held_out())
        logger.log(step, metrics)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            run.checkpoint(step, learners, pending.sampler_state if pending else sampler.state_dict())
        if pending is None and step < total:
            pending = start(step)


def _step_metrics(fits: list[Any], samples: int, sync: dict[str, float], t0: float, t1: float,
                  t2: float) -> dict[str, float]:
    """Training metrics (means over ranks and optimizer steps) and the step's timings."""
    t3 = time.perf_counter()
    train = mean_metrics([s for fit in fits for s in fit.steps])
    ref = max(fit.logprob_seconds for fit in fits)
    return {**{(k if k in ("lr", "grad_norm") else f"train/{k}"): v for k, v in train.items()},
            "time/ref": ref, "time/train": t2 - t1 - ref, "time/sync": t3 - t2, "time/step": t3 - t0,
            "samples_per_s": samples / (t3 - t0), "sync_mib": sync["bytes"] / 2**20}
