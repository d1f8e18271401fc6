"""`rlkit sft`: the SFT driver. It holds tokenised data and the sampler, never model weights.

Loop: sample a global batch (curriculum) -> shard into micro-batches per rank -> learners
step -> metrics -> eval / early stopping -> atomic checkpoint. Final model from rank 0.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import yaml

from rlkit.checkpoint import CheckpointManager, resolve_resume
from rlkit.config import SFTConfig
from rlkit.recipe import to_dict

log = logging.getLogger("rlkit")


def prepare_inputs(cfg: SFTConfig) -> None:
    """Check the model path; build the offline tiny model / synthetic task where the recipe asks
    for them and they are missing. Shared by SFT and GRPO; runs before Ray starts."""
    from rlkit.models import check_model_path, ensure_tiny_model

    ensure_tiny_model(cfg.model)
    check_model_path(cfg.model.path)
    if cfg.data.synthetic_seed is not None and not Path(cfg.data.train).exists():
        from rlkit.tiny import write_task_data

        write_task_data(Path(cfg.data.train).parent, seed=cfg.data.synthetic_seed)


def encode_rows(cfg: SFTConfig, path: str, tokenizer: Any) -> tuple[list[dict], list[str | None], int]:
    """(encoded samples, difficulty per sample, skipped rows) for one data file."""
    from rlkit.data.collate import encode_sft
    from rlkit.data.formats import load_rows

    loaded = load_rows(path, cfg.data.format, cfg.data.dataset, cfg.data.skip_bad_rows)
    if loaded.skipped:
        log.warning("%s: skipped %d bad rows (data.skip_bad_rows)", path, loaded.skipped)
    template = cfg.data.template
    encoded = [encode_sft(r, tokenizer, template, cfg.data.cutoff_len) for r in loaded.rows]
    return encoded, [r.get("difficulty") for r in loaded.rows], loaded.skipped


def micro_batches(samples: list[dict], per_micro: int, packing: bool, max_len: int, pad_id: int) -> list[dict]:
    """Collate consecutive groups of `per_micro` samples; packed rows keep attention per sample."""
    from rlkit.data.collate import pack_collate, pad_collate

    out = []
    for i in range(0, len(samples), per_micro):
        chunk = samples[i:i + per_micro]
        batch = pack_collate(chunk, max_len, pad_id) if packing else pad_collate(chunk, pad_id)
        out.append({k: v for k, v in batch.items() if hasattr(v, "shape")})
    return out


def shard_step(samples: list[dict], world: int, grad_accum: int, mbs: int, packing: bool, max_len: int,
               pad_id: int) -> list[list[dict]]:
    """Split one global batch into `world` lists of `grad_accum` micro-batches."""
    per_rank = grad_accum * mbs
    return [micro_batches(samples[r * per_rank:(r + 1) * per_rank], mbs, packing, max_len, pad_id)
            for r in range(world)]


def evaluate(group: Any, samples: list[dict], world: int, mbs: int, pad_id: int, max_batches: int | None) -> float:
    """Token-mean eval NLL over `samples` (split across ranks)."""
    batches = micro_batches(samples, mbs, False, 0, pad_id)
    if max_batches:
        batches = batches[:max_batches]
    # Every rank must run the same number of forwards (ZeRO-3 gathers are collective).
    batches = batches[:max(world, len(batches) - len(batches) % world)]
    shards = [(batches[r::world],) for r in range(world)]
    results = group.call_each("eval_nll", shards)
    total, count = sum(r[0] for r in results), sum(r[1] for r in results)
    return total / max(count, 1)


def run_sft(cfg: SFTConfig, recipe_path: str | Path | None = None) -> Path:
    """Run SFT from a loaded recipe; returns the final model directory."""
    from rlkit.accel import detect
    from rlkit.data.curriculum import CurriculumSampler
    from rlkit.engine.group import LearnerGroup, start_ray
    from rlkit.engine.learner import LearnerSpec
    from rlkit.metrics import MetricsLogger
    from rlkit.models import load_tokenizer

    device = detect(cfg.device)
    prepare_inputs(cfg)
    tokenizer = load_tokenizer(cfg.model)
    train, difficulties, _ = encode_rows(cfg, cfg.data.train, tokenizer)
    evalset = encode_rows(cfg, cfg.data.eval, tokenizer)[0] if cfg.data.eval else []
    t = cfg.train
    world, global_batch = t.num_learners, t.micro_batch_size * t.grad_accum * t.num_learners
    total = t.max_steps or max(1, math.ceil(t.epochs * len(train) / global_batch))
    sampler = CurriculumSampler(difficulties, total, global_batch, cfg.seed, cfg.curriculum.levels,
                                [(p.until, p.mix) for p in cfg.curriculum.phases], cfg.curriculum.enabled)
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"stage": "sft", **to_dict(cfg)}, sort_keys=False,
                                                       allow_unicode=True), encoding="utf-8")
    ckpts = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    resume = resolve_resume(ckpts, cfg.checkpoint.resume)

    started_ray = start_ray(cfg.ray, device)
    spec = LearnerSpec(cfg.model, cfg.finetuning, cfg.lora, cfg.qlora, cfg.optim, cfg.deepspeed,
                       t.micro_batch_size, t.grad_accum, total, cfg.seed, cfg.device)
    group = LearnerGroup(spec, world, device, cfg.ray)
    state: dict[str, Any] = {"best_eval": None, "best_step": None, "bad_evals": 0}
    step = 0
    if resume is not None:
        group.call("load_checkpoint", str(resume))
        saved = CheckpointManager.load_state(resume)
        sampler.load_state_dict(saved["sampler"])
        step, state = saved["step"], saved["driver"]
        log.warning("resumed from %s (step %d)", resume, step)
    logger = MetricsLogger(run_dir, cfg.logging, total, start_step=step, config=to_dict(cfg), name="sft")
    try:
        if step == 0 and evalset:
            logger.log(0, {"eval_loss": evaluate(group, evalset, world, t.micro_batch_size,
                                                 tokenizer.pad_token_id, cfg.eval.max_batches)})
        while step < total:
            t0 = time.time()
            batch = [train[i] for i in sampler.next_batch()]
            shards = shard_step(batch, world, t.grad_accum, t.micro_batch_size, cfg.data.packing,
                                cfg.data.cutoff_len, tokenizer.pad_token_id)
            results = group.call_each("sft_step", [(s,) for s in shards])
            step += 1
            tokens = sum(r["tokens"] for r in results)  # loss (response) tokens
            seconds = time.time() - t0
            inputs = sum(len(s["input_ids"]) for s in batch)  # prompt + response, no padding
            metrics = {"loss": sum(r["loss_sum"] for r in results) / max(tokens, 1), "lr": results[0]["lr"],
                       "grad_norm": results[0]["grad_norm"], "tokens_per_s": tokens / seconds,
                       "input_tokens": inputs, "input_tokens_per_s": inputs / seconds, "step_time_s": seconds,
                       **{f"mix/{k}": v for k, v in sampler.phase_mix(step - 1).items()}}
            stop = False
            if evalset and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total):
                metrics["eval_loss"] = evaluate(group, evalset, world, t.micro_batch_size,
                                                tokenizer.pad_token_id, cfg.eval.max_batches)
                metrics["eval_ppl"] = math.exp(min(metrics["eval_loss"], 50.0))
                stop = _early_stopping(state, metrics["eval_loss"], step, cfg)
            logger.log(step, metrics)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or stop:
                _checkpoint(group, ckpts, step, sampler, state)
            if stop:
                log.warning("early stopping at step %d: eval loss has not improved for %d evals",
                            step, cfg.eval.patience)
                break
        final = run_dir / "final"
        best = ckpts.root / f"step-{state['best_step']}" if state["best_step"] is not None else None
        if best is not None and best.exists() and state["best_step"] != step:
            group.call("load_checkpoint", str(best))  # keep the best checkpoint's weights as the output
        group.call("save_model", str(final), cfg.model.tokenizer or cfg.model.path)
        return final
    finally:
        logger.close()
        group.shutdown()
        if started_ray:
            import ray

            ray.shutdown()


def _early_stopping(state: dict, eval_loss: float, step: int, cfg: SFTConfig) -> bool:
    best = state["best_eval"]
    if best is None or eval_loss < best - cfg.eval.min_delta:
        state.update(best_eval=eval_loss, best_step=step, bad_evals=0)
        return False
    state["bad_evals"] += 1
    return cfg.eval.patience is not None and state["bad_evals"] >= cfg.eval.patience


def _checkpoint(group: Any, ckpts: CheckpointManager, step: int, sampler: Any, state: dict) -> None:
    staging = ckpts.staging_dir(step)
    group.call("save_checkpoint", str(staging))
    protect = {state["best_step"]} if state["best_step"] is not None else set()
    ckpts.commit(staging, step, {"sampler": sampler.state_dict(), "driver": state}, protect)
