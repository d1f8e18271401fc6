"""`rlkit sft`: the SFT driver. It holds tokenised data and the sampler, never model weights.

Loop: sample a global batch (curriculum) -> shard into micro-batches per rank -> learners
step -> metrics -> eval / early stopping -> atomic checkpoint. Final model from rank 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.learner.objective import MicroBatch, step_normaliser
from rlkit.learner.perf import perf_metrics
from rlkit.run.checkpoint import dir_bytes
from rlkit.run.driver import (
    curriculum_sampler,
    devices_line,
    learner_demand,
    learner_group,
    learner_spec,
    memory_metrics,
    prepare_inputs,
)
from rlkit.run.rundir import RunDir
from rlkit.sft.config import SFTConfig, SFTDataConfig, SFTEvalConfig
from rlkit.sft.memory import MEMORY
from rlkit.sft.objective import NLLObjective

if TYPE_CHECKING:
    from rlkit.data.curriculum import CurriculumSampler
    from rlkit.data.images import ImageInputs
    from rlkit.learner.group import LearnerGroup
    from rlkit.run.metrics import MetricsLogger

log = logging.getLogger("rlkit")


@dataclass
class SFTData:
    """Tokenised rows: train samples with their difficulty, held-out samples (each a compact
    `TokenRows`: indexing gives a sample's lists), the pad id, the template they were rendered
    with (`data.template`, `auto` resolved)."""

    train: Sequence[dict]
    difficulties: list[str | None]
    eval: Sequence[dict]
    pad_id: int
    template: str = "alpaca"
    notes: list[str] = field(default_factory=list)  # lines for the console before training
    images: ImageInputs | None = None  # a vision-language model's processor, for rows with images


def load_sft_data(data: SFTDataConfig, tokenizer: Any, seed: int = 0, images: ImageInputs | None = None) -> SFTData:
    """Load, validate and tokenise `data.train` (and `data.eval`); errors name file and row.
    `seed` draws a dataset_info entry's `num_samples` rows; `images`: a vision-language model's
    processor (rows with images need one)."""
    from jinja2 import TemplateError

    from rlkit.data.collate import encode_sft
    from rlkit.data.formats import load_rows
    from rlkit.data.store import TokenRows
    from rlkit.data.templates import resolve_template
    from rlkit.errors import DataError

    template, notes = data.template, []

    def encode(path: str, skip_bad_rows: bool, split: str | None) -> tuple[TokenRows, list[str | None]]:
        nonlocal template
        loaded = load_rows(path, data.format, data.dataset, skip_bad_rows, split, seed=seed)
        if loaded.rows and template == "auto":
            template = resolve_template(template, loaded.rows[0], tokenizer, loaded.source)
        lengths: list[int] = []
        encoded, difficulties = TokenRows(), []
        for n, row in enumerate(loaded.rows, 1):
            difficulties.append(row.get("difficulty"))
            if data.packing and row.get("images"):
                raise DataError(f"{loaded.source}: row {n} has images, and rows with images are not packed (the "
                                "image features follow the rows): set data.packing: false")
            try:
                encoded.append(encode_sft(row, tokenizer, template, data.cutoff_len, data.mask_history, lengths,
                                          images))
            except TemplateError as e:  # the chat template's own check (roles, alternation)
                raise DataError(f"{loaded.source}: row {n}: the tokenizer's chat template refuses it ({e}); fix the "
                                "row, or set data.template: alpaca") from None
            except DataError as e:
                raise DataError(f"{loaded.source}: row {n}: {e}") from None
        note = report_truncation(loaded.source, lengths, data.cutoff_len)
        notes.extend([note] if note else [])
        return encoded, difficulties

    train, difficulties = encode(data.train, data.skip_bad_rows, data.split)
    held_out = encode(data.eval, False, data.eval_split)[0] if data.eval else TokenRows()
    return SFTData(train, difficulties, held_out, tokenizer.pad_token_id, template, notes, images)


TRUNCATION_WARN_SHARE = 0.1


def report_truncation(source: str, lengths: list[int], cutoff_len: int) -> str | None:
    """When rows are longer than cutoff_len (they are cut: a cut response loses its eos), the
    line that says how many: a warning now when more than TRUNCATION_WARN_SHARE of them are,
    else returned, for the console before training."""
    cut = sum(n > cutoff_len for n in lengths)
    if not cut:
        return None
    share = cut / len(lengths)
    line = (f"{source}: {cut} of {len(lengths)} rows ({100 * share:.0f}%) are longer than data.cutoff_len "
            f"{cutoff_len} tokens and are cut (longest {max(lengths)})")
    if share <= TRUNCATION_WARN_SHARE:
        return line
    log.warning("%s; raise cutoff_len if the responses matter to the end", line)
    return None


def micro_batches(samples: list[dict], per_micro: int, packing: bool, pad_id: int,
                  images: ImageInputs | None = None) -> list[MicroBatch]:
    """Collate consecutive groups of `per_micro` samples, padded or packed padding-free into one
    row (attention stays per sample); samples with images add the model's pixel inputs."""
    from rlkit.data.collate import pack_collate, pad_collate

    out = []
    for chunk in (samples[i:i + per_micro] for i in range(0, len(samples), per_micro)):
        tensors = pack_collate(chunk) if packing else pad_collate(chunk, pad_id)
        if images is not None:
            tensors.update(images.pixels([s.get("images") for s in chunk], tensors["input_ids"]))
        out.append(MicroBatch(tensors))
    return out


def shard_step(samples: list[dict], world: int, grad_accum: int, mbs: int, packing: bool,
               pad_id: int, images: ImageInputs | None = None) -> list[list[MicroBatch]]:
    """Split one global batch into `world` lists of `grad_accum` micro-batches, each carrying the
    step's `num_items_in_batch` (TRL's reduction: `NLLObjective`)."""
    import torch

    per_rank = grad_accum * mbs
    shards = [micro_batches(samples[r * per_rank:(r + 1) * per_rank], mbs, packing, pad_id, images)
              for r in range(world)]
    tokens = sum(int(NLLObjective().positions(mb).sum()) for shard in shards for mb in shard)
    norm = torch.tensor(step_normaliser(tokens, world, grad_accum), dtype=torch.float64)
    return [[MicroBatch({**mb, "num_items_in_batch": norm}) for mb in shard] for shard in shards]


def eval_loss(learners: LearnerGroup, samples: list[dict], mbs: int, pad_id: int, max_batches: int | None,
              images: ImageInputs | None = None) -> float:
    """Token-mean NLL over `samples`, split across the learners."""
    world = learners.size
    batches = micro_batches(samples, mbs, False, pad_id, images)
    if max_batches:
        batches = batches[:max_batches]
    # Every rank must run the same number of forwards (ZeRO-3 gathers are collective).
    batches = batches[:max(world, len(batches) - len(batches) % world)]
    sums = learners.evaluate([batches[r::world] for r in range(world)], NLLObjective())
    return sums["nll"] / max(sums["tokens"], 1)


@dataclass
class EarlyStopping:
    """Best eval loss so far, its step, and evals since it improved by more than `min_delta`."""

    best_eval: float | None = None
    best_step: int | None = None
    bad_evals: int = 0

    def update(self, eval_loss: float, step: int, cfg: SFTEvalConfig) -> bool:
        """Record an eval; True when `patience` evals in a row did not improve."""
        if self.best_eval is None or eval_loss < self.best_eval - cfg.min_delta:
            self.best_eval, self.best_step, self.bad_evals = eval_loss, step, 0
            return False
        self.bad_evals += 1
        return cfg.patience is not None and self.bad_evals >= cfg.patience

    def state(self) -> dict[str, Any]:
        return {"best_eval": self.best_eval, "best_step": self.best_step, "bad_evals": self.bad_evals}


def check_packing(cfg: SFTConfig, device: Any) -> None:
    """Before launch: `data.packing` only for a model without layers that carry a state."""
    from rlkit.model.attention import check_packable
    from rlkit.model.facts import model_facts

    if cfg.data.packing:
        check_packable(model_facts(cfg.model).config, cfg.model.path, "data.packing",
                       "set data.packing: false (a row per sample, padded)")


def run_sft(cfg: SFTConfig, recipe_path: str | Path | None = None) -> Path:
    """Run SFT from a loaded recipe; returns the final model directory."""
    from rlkit.accel import detect
    from rlkit.model.load import load_image_inputs, load_tokenizer

    device = detect(cfg.device)
    cfg = prepare_inputs(cfg, device, MEMORY, checks=[check_packing], learners=cfg.train.num_learners)
    tokenizer = load_tokenizer(cfg.model)
    data = load_sft_data(cfg.data, tokenizer, cfg.seed, load_image_inputs(cfg.model, tokenizer))
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum * t.num_learners
    total = t.max_steps or max(1, math.ceil(t.epochs * len(data.train) / global_batch))
    sampler = curriculum_sampler(cfg.curriculum, data.difficulties, total, global_batch, cfg.seed, cfg.data.train)
    run = RunDir(cfg, "sft", template=data.template)
    for line in [_plan(cfg, data, total, device), *data.notes]:
        run.announce(line)
    spec = learner_spec(cfg, t.micro_batch_size, t.grad_accum, total)
    learners_wanted = learner_demand(cfg, t.num_learners, device, "train.num_learners")
    with run.session(), learner_group(cfg, spec, t.num_learners, device, [learners_wanted]) as learners:
        resumed = run.resume(learners, sampler)
        step, stopping = resumed.step, EarlyStopping(**resumed.driver)
        logger = run.logger(cfg.logging, total, step)
        try:
            with run.stops.caught():
                step = _train(cfg, run, learners, sampler, data, stopping, logger, step, total)
        finally:
            logger.close()
        best = stopping.best_step
        if best is not None and best != step and (run.ckpts.root / f"step-{best}").exists():
            learners.load_checkpoint(run.ckpts.root / f"step-{best}")  # the best weights are the output
        return run.save_final(learners, cfg.model.tokenizer or cfg.model.path, dir_bytes(cfg.model.path))


def _plan(cfg: SFTConfig, data: SFTData, total: int, device: Any) -> str:
    """The run's numbers in one line, before it starts (as the HF Trainer's banner)."""
    t = cfg.train
    batch = t.micro_batch_size * t.grad_accum * t.num_learners
    per_epoch = max(1, math.ceil(len(data.train) / batch))
    held_out = f", {len(data.eval)} held out" if data.eval else ""
    return (f"rlkit sft: {len(data.train)} training rows{held_out}; {batch} rows per step (micro_batch_size "
            f"{t.micro_batch_size} x grad_accum {t.grad_accum} x {t.num_learners} learner"
            f"{'s' * (t.num_learners > 1)}); {per_epoch} steps per epoch; {total} steps "
            f"({total / per_epoch:.2f} epochs); {data.template} template; {devices_line(device, t.num_learners)}")


def _train(cfg: SFTConfig, run: RunDir, learners: LearnerGroup, sampler: CurriculumSampler, data: SFTData,
           stopping: EarlyStopping, logger: MetricsLogger, step: int, total: int) -> int:
    """The steps from `step` to `total` (or to early stopping); returns the last step."""
    t, objective = cfg.train, NLLObjective()
    evaluate = lambda: eval_loss(learners, data.eval, t.micro_batch_size, data.pad_id, cfg.eval.max_batches,  # noqa: E731
                                 data.images)
    if step == 0 and data.eval:
        logger.log(0, {"eval/loss": evaluate()})
    while step < total:
        t0 = time.time()
        batch = [data.train[i] for i in sampler.next_batch()]
        shards = shard_step(batch, learners.size, t.grad_accum, t.micro_batch_size, cfg.data.packing, data.pad_id,
                            data.images)
        results = learners.train_step(shards, objective)
        step += 1
        metrics = _step_metrics(results, batch, time.time() - t0, sampler.phase_mix(step - 1))
        stop = False
        if data.eval and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total):
            metrics["eval/loss"] = evaluate()
            metrics["eval/ppl"] = math.exp(min(metrics["eval/loss"], 50.0))
            stop = stopping.update(metrics["eval/loss"], step, cfg.eval)
        if step in (1, total):  # peak memory per process
            metrics.update(memory_metrics(learners))
        logger.log(step, metrics)
        if run.checkpoint_due(step, cfg.checkpoint.every, also=stop):
            protect = {stopping.best_step} if stopping.best_step is not None else set()
            run.checkpoint(step, learners, sampler.state_dict(), stopping.state(), protect)
        run.stops.stop_if_signalled(step)
        if stop:
            log.warning("early stopping at step %d: eval loss has not improved for %d evals",
                        step, cfg.eval.patience)
            break
    return step


def _step_metrics(results: list[Any], batch: list[dict], seconds: float, mix: dict[str, float]) -> dict[str, float]:
    tokens = sum(r.sums["tokens"] for r in results)  # loss (response) tokens
    inputs = sum(len(s["input_ids"]) for s in batch)  # prompt + response, no padding
    return {"train/loss": sum(r.sums["nll"] for r in results) / max(tokens, 1), "train/lr": results[0].lr,
            "train/grad_norm": results[0].grad_norm, "train/tokens_per_s": tokens / seconds,
            "train/input_tokens": inputs, "train/input_tokens_per_s": inputs / seconds, "time/step": seconds,
            **perf_metrics([[r] for r in results]), **{f"mix/{k}": v for k, v in mix.items()}}
