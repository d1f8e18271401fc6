"""`rlkit dpo`: the preference-optimisation driver, and the loop every stage on preference pairs
shares (`run_pairs`: `rlkit rm` too). It holds the tokenised pairs and the sampler, never model
weights.

Loop: sample a global batch of pairs -> per rank `grad_accum` micro-batches of chosen and rejected
rows -> each learner scores its micro-batches under the reference (the frozen copy, or the policy
with its LoRA adapters disabled), then steps TRL's DPO loss (`Learner.fit`) -> metrics under TRL's
names -> held-out loss and reward accuracy -> atomic checkpoint. Final model from rank 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.dpo.config import DPOConfig, PreferenceDataConfig
from rlkit.dpo.memory import MEMORY
from rlkit.dpo.objective import (
    DPOObjective,
    ReferenceFreeObjective,
    cut,
    pair_means,
    preference_batch,
    without_padding,
)
from rlkit.dpo.reference import ReferenceOnce
from rlkit.learner.objective import MicroBatch
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
from rlkit.sft.run import report_truncation

if TYPE_CHECKING:
    from rlkit.learner.group import LearnerGroup

log = logging.getLogger("rlkit")


@dataclass
class PairData:
    """Tokenised pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`, each side cut to
    `data.cutoff_len` with its prompt), their difficulty, the held-out pairs, the pad id and the
    template they were rendered with."""

    train: list[dict[str, list[int]]]
    difficulties: list[str | None]
    eval: list[dict[str, list[int]]]
    pad_id: int
    template: str = "alpaca"
    notes: list[str] = field(default_factory=list)
    kept: dict[str, Any] | None = None  # what checkpoints keep beside the learners (reference logprobs computed once)


def truncate_pair(pair: dict[str, list[int]], cutoff_len: int, mode: str) -> dict[str, list[int]]:
    """Each side's prompt + response cut to `cutoff_len` (`cut`), its prompt kept as `<side>_prompt`."""
    out: dict[str, list[int]] = {}
    for side in ("chosen", "rejected"):
        out[f"{side}_prompt"], out[f"{side}_ids"] = cut(pair["prompt_ids"], pair[f"{side}_ids"], cutoff_len, mode)
    return out


@dataclass(frozen=True)
class RowKind:
    """What a stage on preference data trains on, for `load_encoded`: how a file is read (`load`:
    path, format, dataset, skip_bad_rows, split, seed), the SFT row of a row (its first
    response, for the template's choice), a row's token ids (`encode`, untruncated), their full
    lengths (`lengths`), what is kept once cut to `data.cutoff_len` (`keep`: the encoding, the row,
    the cutoff, the truncation mode) and the words for it in messages."""

    load: Callable[..., Any]
    sft_row: Callable[[dict], dict]
    encode: Callable[[dict, Any, str], dict]
    lengths: Callable[[dict], list[int]]
    keep: Callable[[dict, dict, int, str], dict]
    sides: str  # what the truncation line counts
    response: str  # what a prompt must leave room for


def _pair_kind() -> RowKind:
    from rlkit.data.preference import encode_pair, load_pairs, side_rows

    return RowKind(load_pairs, lambda row: side_rows(row)[0], encode_pair,
                   lambda pair: [len(pair["prompt_ids"]) + len(pair[s]) for s in ("chosen_ids", "rejected_ids")],
                   lambda pair, row, cutoff, mode: {**truncate_pair(pair, cutoff, mode),
                                                    **({"margin": row["margin"]} if "margin" in row else {})},
                   "chosen and rejected sides", "a response")


def load_pair_data(data: PreferenceDataConfig, tokenizer: Any, seed: int = 0) -> PairData:
    """`load_encoded` of preference pairs."""
    return load_encoded(data, tokenizer, _pair_kind(), seed)


def load_encoded(data: PreferenceDataConfig, tokenizer: Any, kind: RowKind, seed: int = 0) -> PairData:
    """Load, check and tokenise `data.train` (and `data.eval`) as `kind` says; a bad row is one line
    naming the file, the row and the column; a row whose prompt leaves no room for its response
    under `data.cutoff_len` (keep_start) is one too."""
    from jinja2 import TemplateError

    from rlkit.data.templates import resolve_template
    from rlkit.errors import DataError

    template, notes = data.template, []

    def encode(path: str, skip_bad_rows: bool, split: str | None) -> tuple[list[dict], list[str | None]]:
        nonlocal template
        loaded = kind.load(path, data.format, data.dataset, skip_bad_rows, split, seed=seed)
        if template == "auto":
            template = resolve_template(template, kind.sft_row(loaded.rows[0]), tokenizer, loaded.source)
        rows, difficulties, lengths = [], [], []
        for n, row in enumerate(loaded.rows, 1):
            try:
                enc = kind.encode(row, tokenizer, template)
            except TemplateError as e:
                raise DataError(f"{loaded.source}: row {n}: the tokenizer's chat template refuses it ({e}); fix the "
                                "row, or set data.template: alpaca") from None
            except DataError as e:
                raise DataError(f"{loaded.source}: row {n}: {e}") from None
            if data.truncation_mode == "keep_start" and len(enc["prompt_ids"]) >= data.cutoff_len:
                raise DataError(f"{loaded.source}: row {n}: its prompt is {len(enc['prompt_ids'])} tokens, which "
                                f"leaves no room for {kind.response} under data.cutoff_len {data.cutoff_len}: raise "
                                "cutoff_len, or set data.truncation_mode: keep_end")
            lengths += kind.lengths(enc)
            rows.append(kind.keep(enc, row, data.cutoff_len, data.truncation_mode))
            difficulties.append(row.get("difficulty"))
        note = report_truncation(f"{loaded.source} ({kind.sides})", lengths, data.cutoff_len)
        notes.extend([note] if note else [])
        return rows, difficulties

    train, difficulties = encode(data.train, data.skip_bad_rows, data.split)
    held_out = encode(data.eval, False, data.eval_split)[0] if data.eval else []
    return PairData(train, difficulties, held_out, tokenizer.pad_token_id, template, notes)


Collate = Callable[[list[dict[str, Any]], int], dict[str, Any]]  # rows, pad id -> a micro-batch's tensors


def micro_batches(pairs: Sequence[dict[str, Any]], per_micro: int, pad_id: int,
                  collate: Collate = preference_batch) -> list[MicroBatch]:
    """Consecutive groups of `per_micro` pairs (or rows), each one micro-batch (`collate`: a pair's
    chosen rows then its rejected rows)."""
    return [MicroBatch(collate(list(pairs[i:i + per_micro]), pad_id)) for i in range(0, len(pairs), per_micro)]


def shard_step(pairs: list[dict], world: int, grad_accum: int, mbs: int, pad_id: int,
               collate: Collate = preference_batch) -> list[list[list[MicroBatch]]]:
    """One global batch as each rank's one optimizer step of `grad_accum` micro-batches."""
    per_rank = grad_accum * mbs
    return [[micro_batches(pairs[r * per_rank:(r + 1) * per_rank], mbs, pad_id, collate)] for r in range(world)]


def eval_metrics(learners: LearnerGroup, pairs: list[dict], mbs: int, pad_id: int, max_batches: int | None,
                 objective: Any, means: Callable[[dict[str, float]], dict[str, float]],
                 collate: Collate = preference_batch) -> dict[str, float]:
    """The held-out pairs' loss and metrics (`means` of the objective's sums), split across ranks."""
    world = learners.size
    batches = micro_batches(pairs, mbs, pad_id, collate)[:max_batches or None]
    batches = batches[:max(world, len(batches) - len(batches) % world)]  # as many forwards on every rank (ZeRO-3)
    return means(learners.evaluate([batches[r::world] for r in range(world)], objective))


@dataclass(frozen=True)
class PairStage:
    """What a stage that trains on pairs puts in the loop below: its name, its objective, how its
    summed metrics become the logged ones, whether the learners hold the reference, the model's
    end (`rlkit.model.load.HEADS`) and the words for the plan line."""

    name: str
    objective: Any
    means: Callable[[dict[str, float]], dict[str, float]]
    reference: bool
    head: str
    describe: str
    load: Callable[[Any, Any, int], PairData] | None = None  # data, tokenizer, seed -> rows (default: pairs)
    collate: Collate = preference_batch
    unit: str = "pairs"
    checks: tuple[Callable[[Any, Any], None], ...] = ()  # (cfg, device) -> None, before launch
    layout: str = "padded rows"  # how a micro-batch's rows reach the model, for the plan line
    reference_once: ReferenceOnce | None = None  # the reference's logprobs computed before the first step
    mix_reference: tuple[int, float] | None = None  # TR-DPO: every so many steps, the policy's share


def run_dpo(cfg: DPOConfig, recipe_path: str | Path | None = None) -> Path:
    """Run DPO from a loaded recipe; returns the final model directory."""
    d = cfg.dpo
    rows = {"collate": without_padding(preference_batch) if d.padding_free else preference_batch,
            "checks": (_check_model,), "layout": "padding-free rows" if d.padding_free else "padded rows"}
    if d.reference_free:
        objective = ReferenceFreeObjective(d.loss_type[0], d.beta, d.cpo_alpha, d.simpo_gamma, d.label_smoothing)
        return run_pairs(cfg, PairStage("dpo", objective, pair_means, False, "lm",
                                        f"loss {d.loss_type[0]}, beta {d.beta}; no reference", **rows))
    full = cfg.finetuning == "full"
    once = ReferenceOnce("policy" if full else "reference", d.ld_alpha) if d.precompute_ref_log_probs else None
    reference = "a frozen copy" if full else "the policy with its adapters disabled"
    if once:
        reference = f"{'the starting policy' if full else reference}, once before training"
    mix = (d.ref_model_sync_steps, d.ref_model_mixup_alpha) if d.sync_ref_model else None
    if mix:
        reference += f", moved toward the policy every {mix[0]} steps (alpha {mix[1]})"
    objective = DPOObjective(d.terms(), needs=() if once else ("ref_logp",))
    return run_pairs(cfg, PairStage("dpo", objective, pair_means, not (once and full), "lm",
                                    f"loss {'+'.join(d.loss_type)}, beta {d.beta}; reference: {reference}",
                                    reference_once=once, mix_reference=mix, **rows))


def _check_model(cfg: DPOConfig, device: Any) -> None:
    """Before launch: `dpo.padding_free` only for a model without layers that carry a state, and
    `dpo.use_weighting` only for one whose logits are its lm_head's."""
    from rlkit.model.attention import check_packable
    from rlkit.model.checks import check_head_only
    from rlkit.model.facts import model_facts

    d = cfg.dpo
    if d.padding_free or d.use_weighting:
        config = model_facts(cfg.model).config
        if d.padding_free:
            check_packable(config, cfg.model.path, "dpo.padding_free",
                           "set dpo.padding_free: false (a row per side, padded)")
        if d.use_weighting:
            check_head_only(config, cfg.model.path, "dpo.use_weighting", "set dpo.use_weighting: false")


def run_pairs(cfg: Any, stage: PairStage) -> Path:
    """A stage on preference pairs (`rlkit dpo`, `rlkit rm`) from its loaded recipe; returns the
    final model directory."""
    from rlkit.accel import detect
    from rlkit.model.load import load_tokenizer

    device = detect(cfg.device)
    cfg = prepare_inputs(cfg, device, MEMORY, checks=list(stage.checks), learners=cfg.train.num_learners)
    tokenizer = load_tokenizer(cfg.model)
    data = (stage.load or load_pair_data)(cfg.data, tokenizer, cfg.seed)
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum * t.num_learners
    total = t.max_steps or max(1, math.ceil(t.epochs * len(data.train) / global_batch))
    sampler = curriculum_sampler(cfg.curriculum, data.difficulties, total, global_batch, cfg.seed, cfg.data.train)
    run = RunDir(cfg, stage.name, template=data.template)
    for line in [_plan(cfg, stage, data, total, device), *data.notes]:
        run.announce(line)
    spec = learner_spec(cfg, t.micro_batch_size, t.grad_accum, total, reference=stage.reference, head=stage.head)
    wanted = learner_demand(cfg, t.num_learners, device, "train.num_learners")
    with run.session(), learner_group(cfg, spec, t.num_learners, device, [wanted]) as learners:
        resumed = run.resume(learners, sampler)
        step = resumed.step
        if stage.reference_once:
            t0 = time.time()
            batches = lambda pairs: micro_batches(pairs, t.micro_batch_size, data.pad_id, stage.collate)  # noqa: E731
            data = stage.reference_once.attach(learners, data, stage.objective, batches,
                                               (resumed.payload or {}).get("reference"))
            if not resumed.payload:
                run.announce(f"rlkit {stage.name}: the reference's logprobs of {len(data.train) + len(data.eval)} "
                             f"{stage.unit} computed in {time.time() - t0:.1f} s")
        logger = run.logger(cfg.logging, total, step)
        try:
            with run.stops.caught():
                step = _train(cfg, stage, run, learners, sampler, data, logger, step, total)
        finally:
            logger.close()
        return run.save_final(learners, cfg.model.tokenizer or cfg.model.path, dir_bytes(cfg.model.path))


def _plan(cfg: Any, stage: PairStage, data: PairData, total: int, device: Any) -> str:
    t = cfg.train
    batch = t.micro_batch_size * t.grad_accum * t.num_learners
    per_epoch = max(1, math.ceil(len(data.train) / batch))
    held_out = f", {len(data.eval)} held out" if data.eval else ""
    return (f"rlkit {stage.name}: {len(data.train)} training {stage.unit}{held_out}; {batch} {stage.unit} per step "
            f"(micro_batch_size {t.micro_batch_size} x grad_accum {t.grad_accum} x {t.num_learners} learner"
            f"{'s' * (t.num_learners > 1)}); {total} steps ({total / per_epoch:.2f} epochs); {stage.layout}; "
            f"{stage.describe}; "
            f"{data.template} template; {devices_line(device, t.num_learners)}")


def _train(cfg: Any, stage: PairStage, run: RunDir, learners: LearnerGroup, sampler: Any, data: PairData,
           logger: Any, step: int, total: int) -> int:
    """The steps from `step` to `total`; returns the last step."""
    t, objective = cfg.train, stage.objective
    evaluate = lambda: {f"eval/{k}": v for k, v in eval_metrics(  # noqa: E731
        learners, data.eval, t.micro_batch_size, data.pad_id, cfg.eval.max_batches, objective, stage.means,
        stage.collate).items()}
    if step == 0 and data.eval:
        logger.log(0, evaluate())
    while step < total:
        t0 = time.time()
        batch = [data.train[i] for i in sampler.next_batch()]
        results = learners.fit(shard_step(batch, learners.size, t.grad_accum, t.micro_batch_size, data.pad_id,
                                          stage.collate), objective)
        step += 1
        if stage.mix_reference and step % stage.mix_reference[0] == 0:
            learners.mix_reference(stage.mix_reference[1])
        steps = [r.steps[0] for r in results]
        sums: dict[str, float] = {}
        for s in steps:
            for key, value in s.sums.items():
                sums[key] = sums.get(key, 0.0) + value
        seconds = time.time() - t0
        metrics = {f"train/{k}": v for k, v in stage.means(sums).items()}
        metrics.update({"train/lr": steps[0].lr, "train/grad_norm": steps[0].grad_norm, "time/step": seconds,
                        "train/tokens_per_s": sums.get("tokens", 0.0) / seconds,
                        "time/reference": max(r.logprob_seconds for r in results),
                        **perf_metrics([[s] for s in steps]), **{f"mix/{k}": v for k, v in
                                                                 sampler.phase_mix(step - 1).items()}})
        if data.eval and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total):
            metrics.update(evaluate())
        if step in (1, total):
            metrics.update(memory_metrics(learners))
        logger.log(step, metrics)
        if run.checkpoint_due(step, cfg.checkpoint.every):
            run.checkpoint(step, learners, sampler.state_dict(), {}, payload=data.kept)
        run.stops.stop_if_signalled(step)
    return step
