"""`rlkit grpo`: the driver. It holds prompts, the sampler and the reward functions, no weights.

Each step: sample prompts -> vLLM engines generate G completions each -> rewards -> group
advantages -> (reference logprobs) -> learners train -> weights sync into the engines ->
metrics and an atomic checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlkit.config import GRPOConfig

log = logging.getLogger("rlkit")


def run_grpo(cfg: GRPOConfig, recipe_path: str | Path | None = None) -> Path:
    """Run GRPO from a loaded recipe; returns the final policy directory.

    With `grpo.async_generation` the engines generate step k+1 while the learners train step k
    (the batch is one policy version old; the engine's sampling logprobs are the ratio's
    denominator). Ray runs an engine's calls in order, so the weight sync after step k waits
    for that generation to finish and never lands mid-generation.
    """
    from rlkit.grpo.setup import build_run

    run = build_run(cfg, recipe_path)  # checks everything (data, rewards, paths) before Ray starts
    logger = None
    try:
        run.start()
        step = run.resume()
        logger = run.logger(step)
        if step == 0 and cfg.eval.every:
            logger.log(0, run.evaluate())                            # the starting point
        overlap = cfg.grpo.async_generation
        pending = run.launch(step) if step < run.total_steps else None
        while step < run.total_steps:
            t0 = time.perf_counter()
            exp = run.finish(pending, step)                         # generate, score (+ refills)
            batch, adv_metrics = run.batch(exp)                     # advantages, tensors
            pending = run.launch(step + 1) if overlap and step + 1 < run.total_steps else None
            t1 = time.perf_counter()                                # ^ next step generates during training
            plan = run.plan(batch, step)                            # mini/micro-batches per rank
            run.attach_logprobs(batch, plan)                        # reference / old-policy logprobs
            t2 = time.perf_counter()
            train_metrics = run.train(batch, plan)                  # clipped PG loss + KL
            t3 = time.perf_counter()
            sync = run.sync()                                       # learner -> vLLM, no restart
            step += 1
            t4 = time.perf_counter()
            metrics = {**exp.metrics, **adv_metrics, **train_metrics,
                       "time/ref": t2 - t1, "time/train": t3 - t2, "time/sync": t4 - t3, "time/step": t4 - t0,
                       "samples_per_s": len(exp.rollouts) / (t4 - t0),
                       "reward": exp.metrics["reward/mean"], "sync_mb": sync["bytes"] / 2**20}
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == run.total_steps):
                metrics.update(run.evaluate())
            logger.log(step, metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                run.checkpoint(step, pending)
            if pending is None and step < run.total_steps:
                pending = run.launch(step)
        return run.save_final()
    finally:
        if logger is not None:
            logger.close()
        run.shutdown()
