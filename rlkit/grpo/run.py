"""`rlkit grpo`: the driver. It holds prompts, the sampler and the reward functions, no weights.

Each step: sample prompts -> vLLM engines generate G completions each -> rewards -> group
advantages -> one typed batch, sent once to the learners, which score reference / old-policy
logprobs and train -> weights sync into the engines -> metrics and an atomic checkpoint.

With `grpo.max_staleness: K` (K >= 1) the engines generate steps k+1 .. k+K while the learners
train step k (a batch is up to K policy versions old; each rollout carries the version that made
it, and the rollout correction weighs it by pi_learner / pi_engine). Ray runs an engine's calls in
order, so the weight sync after step k waits for the generations queued before it and never
lands mid-generation. The learners go on to step k+1 once the policy is in the object store; the
engines load it meanwhile, and the next generation is sent once they have. A checkpoint waits
for the generations in flight and keeps their samples, so a resumed run trains on exactly what
the uninterrupted one would have.

With `online_difficulty` every scored group tells the sampler whether its prompt was all solved or all
failed; such prompts are drawn less (`grpo/difficulty.py`), a state the sampler's checkpoint keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.accel import RAY_DEVICE_RESOURCES, detect
from rlkit.actors.cluster import Demand
from rlkit.grpo.batch import GRPOBatch, expand_forks, plan_micro_batches, plan_token_micro_batches
from rlkit.grpo.config import GRPOConfig
from rlkit.grpo.difficulty import OnlineDifficulty
from rlkit.grpo.experience import Experience, Generation, advantages, evaluate, start_generation
from rlkit.grpo.memory import MEMORY
from rlkit.grpo.objective import GRPOObjective
from rlkit.grpo.task import Task, load_task, recipe_dir
from rlkit.learner.objective import mean_metrics
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
from rlkit.seeding import derive_seed

if TYPE_CHECKING:
    from rlkit.data.curriculum import CurriculumSampler
    from rlkit.learner.group import LearnerGroup
    from rlkit.learner.teacher import TeacherActor
    from rlkit.rollout.engines import RolloutEngines
    from rlkit.run.metrics import MetricsLogger


def demands(cfg: GRPOConfig, device: Any) -> list[Demand]:
    """What a GRPO recipe asks of the Ray cluster: the learners' bundles, the separate engines' and
    the teacher's own actor's (`distill.placement: actor`)."""
    from rlkit.actors.placement import bundle, engine_cpus

    rollout, custom = cfg.rollout, cfg.ray.resources
    out = [learner_demand(cfg, cfg.grpo.num_learners, device, "grpo.num_learners")]
    if not rollout.colocate:
        tp = rollout.tensor_parallel_size
        out.append(Demand("engine", rollout.num_engines,
                          bundle(device, engine_cpus(device, cfg.ray, tp), tp, custom=custom.engine),
                          cfg.ray.placement, "rollout.num_engines", tuple(custom.engine)))
    if cfg.distill is not None and cfg.distill.placement == "actor":
        out.append(Demand("teacher", 1, bundle(device, cfg.ray.cpus_per_actor, custom=custom.teacher), "pack",
                          "distill.placement", tuple(custom.teacher)))
    return out


def run_grpo(cfg: GRPOConfig, recipe_path: str | Path | None = None) -> Path:
    """Run GRPO from a loaded recipe; returns the final policy directory. Everything a user can
    get wrong (model path, data, rewards, sync strategy) is checked before Ray starts."""
    from rlkit.actors.cluster import ship_by_value
    from rlkit.distill.teacher import check_distill, check_teacher_node
    from rlkit.rollout.engines import start_engines, sync_transport
    from rlkit.rollout.serving import check_engines

    g = cfg.grpo
    device = detect(cfg.device)
    transport = sync_transport(cfg.rollout, device)  # one that runs on this device, resolved once
    cfg = prepare_inputs(cfg, device, MEMORY, checks=[check_packing, check_engines, check_distill],
                         learners=cfg.grpo.num_learners)
    task = load_task(cfg.model, cfg.data, cfg.rewards, g.reward_default, recipe_dir(recipe_path), cfg.seed,
                     cfg.rollout, on_cpu=not device.is_accelerator)
    if task.images is not None:
        check_images(cfg)
    with closing(task.scorer):
        online = cfg.online_difficulty and OnlineDifficulty(len(task.rows), **dataclasses.asdict(cfg.online_difficulty))
        sampler = curriculum_sampler(cfg.curriculum, task.difficulties, g.steps, g.prompts_per_step, cfg.seed,
                                     cfg.data.train, row_filter=online)
        run = RunDir(cfg, "grpo", template=task.template)
        run.announce(_plan(cfg, task, device))
        run.announce(sampling_line(cfg, task.tokenizer))
        beside = cfg.distill is not None and cfg.distill.placement == "learner"  # a teacher copy per learner rank
        spec = learner_spec(cfg, g.micro_batch_size, g.grad_accum, g.steps * g.epochs * g.mini_batches,
                            reference=g.beta > 0, teacher=cfg.distill.teacher if beside else None)
        rewards = [Demand("reward actor", 1, bundle, "pack", f"{key}.args", tuple(
            k for k in bundle if k not in ("CPU", *RAY_DEVICE_RESOURCES)), f"{key}.args.resources")
            for key, bundle in task.scorer.actor_bundles()]
        with run.session(), learner_group(cfg, spec, g.num_learners, device, [*demands(cfg, device), *rewards],
                                          started=lambda: check_teacher_node(cfg.distill)) as learners:
            shipped = ship_by_value(task.scorer.modules())
            if shipped:
                run.announce("rlkit grpo: reward modules go to the Ray workers by value (they are not installed "
                             f"there): {', '.join(shipped)}")
            engines = start_engines(cfg.rollout, cfg.model, device, cfg.ray, learners, cfg.seed, transport,
                                    cfg.lora.r if cfg.lora else 0)
            teacher = None
            if cfg.distill is not None and not beside:  # the teacher in its own actor
                from rlkit.learner.teacher import TeacherActor

                teacher = TeacherActor(cfg.distill.teacher, device, cfg.ray, cfg.distill.node)
                run.announce(f"rlkit distill: the teacher runs in its own actor on node {teacher.node}")
            if task.agent is not None:  # multi-turn: a weight sync waits for the turn loops in flight
                engines.before_sync = task.agent.background.wait_idle
            try:
                resumed = run.resume(learners, sampler)
                step, saved = resumed.step, resumed.payload or {}
                if step:
                    engines.sync_from(learners)  # engines start from model.path: give them the resumed policy
                with closing(run.logger(cfg.logging, g.steps, step)) as logger, run.stops.caught():
                    _train(Parts(cfg, task, sampler, run, learners, engines, logger, teacher), step, saved)
                return run.save_final(learners, cfg.model.tokenizer or cfg.model.path, dir_bytes(cfg.model.path))
            finally:
                engines.shutdown()
                if teacher is not None:
                    teacher.shutdown()


def _plan(cfg: GRPOConfig, task: Task, device: Any) -> str:
    """The run's numbers in one line, before it starts (as the HF Trainer's banner)."""
    g, r = cfg.grpo, cfg.rollout
    updates, passes = g.mini_batches * g.epochs, g.steps * g.prompts_per_step / max(1, len(task.rows))
    held_out = f", {len(task.eval_rows)} held out" if task.eval_rows else ""
    return (f"rlkit grpo: {len(task.rows)} prompts{held_out}; {g.prompts_per_step} prompts x group_size "
            f"{g.group_size} = {g.prompts_per_step * g.group_size} completions per step, {updates} optimizer step"
            f"{'s' * (updates > 1)} on them; {g.steps} steps ({passes:.2f} passes over the prompts); "
            f"{task.template} template; "
            f"{devices_line(device, g.num_learners, r.num_engines, r.tensor_parallel_size, r.colocate)}")


def sampling_line(cfg: GRPOConfig, tokenizer: Any) -> str:
    """What vLLM samples with, in one line: the recipe's rollout settings (rlkit passes every sampling
    parameter, so a model's generation_config.json defaults never apply; named when it has some), and the
    tokens a completion ends at (the tokenizer's EOS and generation_config.json's eos_token_id)."""
    from rlkit.model.load import SAMPLING_FIELDS, generation_config, stop_token_ids

    r = cfg.rollout
    stops = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in stop_token_ids(cfg.model.path, tokenizer))
    line = (f"rlkit grpo: vLLM samples with rollout.temperature {r.temperature:g}, top_p {r.top_p:g}, max_tokens "
            f"{r.max_tokens}{', stop ' + repr(list(r.stop)) if r.stop else ''} (no top_k, min_p or penalties); a "
            f"completion ends at {stops or 'max_tokens'}")
    model_defaults = ", ".join(f"{k} {v}" for k, v in generation_config(cfg.model.path).items() if k in SAMPLING_FIELDS)
    if model_defaults:
        line += (f"; the model's generation_config.json asks for {model_defaults}: not applied, the recipe's "
                 "rollout keys win")
    return line


def eval_sampling(cfg: GRPOConfig) -> Any:
    """How held-out completions are sampled: the rollout's settings, at eval.temperature when set."""
    from rlkit.rollout.generation import sampling

    sample = sampling(cfg.rollout)
    return sample if cfg.eval.temperature is None else dataclasses.replace(sample, temperature=cfg.eval.temperature)


@dataclasses.dataclass(frozen=True)
class Parts:
    """A GRPO run's parts, built by `run_grpo` and handed to its loop whole (as verl's driver holds
    its worker groups)."""

    cfg: GRPOConfig
    task: Task
    sampler: CurriculumSampler
    run: RunDir
    learners: LearnerGroup
    engines: RolloutEngines
    logger: MetricsLogger
    teacher: TeacherActor | None = None  # a distillation teacher's own actor, which scores each batch


def _train(p: Parts, step: int, saved: dict) -> None:
    """The loop, from `step` to `grpo.steps`; `saved`: what a checkpoint held in flight."""
    from rlkit.rollout.generation import sampling

    cfg, task, sampler, run, learners, engines = p.cfg, p.task, p.sampler, p.run, p.learners, p.engines
    logger, teacher = p.logger, p.teacher

    g, total, objective = cfg.grpo, cfg.grpo.steps, GRPOObjective.from_config(cfg.grpo, cfg.rollout, cfg.distill)
    sample = sampling(cfg.rollout)
    version = step  # the policy version the engines hold: optimizer steps synced into them

    def start(at: int, attempt: int = 0) -> Generation:  # draw the step's prompts, start generating
        return start_generation(sampler.next_batch(), task, engines, sample, g.group_size,
                                derive_seed(cfg.seed, "generate", at, attempt), version=version)

    def held_out() -> dict[str, float]:
        return evaluate(task, engines, eval_sampling(cfg), cfg.eval.samples_per_prompt, derive_seed(cfg.seed, "eval"))

    start_check = _sync_check(cfg, task, engines, learners, step, due=True)   # the engines hold the policy?
    if step == 0 and (task.eval_rows or start_check):
        logger.log(0, {**start_check, **(held_out() if task.eval_rows else {})})  # the starting point
    source = _source(p, start, saved, step)
    while step < total:
        t0 = time.perf_counter()
        exp = source.experience(step)                                             # generate, score (+ refills)
        engines.idle()
        seen = _observe(sampler.row_filter, exp)                                  # online difficulty, when on
        adv, adv_metrics = advantages(exp, g)
        batch = GRPOBatch.collate(*expand_forks(exp.rollouts, adv), task.pad_id, g.mask_truncated, task.images)
        t_teacher = time.perf_counter()
        if teacher is not None:                                                   # the teacher's logprobs
            batch = batch.scored(functools.partial(teacher.score, objective=objective), g.micro_batch_size)
        t_teacher = time.perf_counter() - t_teacher
        t1 = time.perf_counter()
        shards = _shards(batch, g, derive_seed(cfg.seed, "plan", step))          # micro-batches per rank
        training = learners.fit_async(shards, objective, g.epochs)               # ref/old logprobs, PG loss + KL
        fits = source.during(training, step)                                      # generates during training
        t2 = time.perf_counter()
        sync = source.sync(learners, step + 1)                                    # learner -> vLLM, no restart
        step, version = step + 1, version + 1
        metrics = {**exp.metrics, **adv_metrics, **seen,
                   **_step_metrics(fits, len(exp.rollouts), sync, t0, t1, t2, exp.engine_seconds, len(engines.names)),
                   **({"time/teacher": t_teacher} if teacher is not None else {}), **engines.recovery(),
                   **_sync_check(cfg, task, engines, learners, step)}                # parity probe, when due
        if task.eval_rows and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total):
            metrics.update(held_out())
        if step in (1, total):                                                    # peak memory per process
            metrics.update(memory_metrics(learners, engines))
        logger.log(step, metrics)
        _log_examples(cfg, task, logger, step, exp, adv)                          # rollouts.jsonl
        if run.checkpoint_due(step, cfg.checkpoint.every):                       # + the generations in flight
            run.checkpoint(step, learners, sampler.state_dict(), payload=source.payload())
        run.stops.stop_if_signalled(step)                                               # SIGTERM: stop here


def _source(p: Parts, start: Callable[..., Generation], saved: dict, step: int) -> Any:
    """Where the steps' experience comes from: streamed groups (`grpo.streaming`), or a generation per
    step, up to `max_staleness` ahead; with what a checkpoint held in flight."""
    from rlkit.grpo.ahead import StepGenerations
    from rlkit.grpo.stream import GroupStream
    from rlkit.grpo.stream_state import stream_from
    from rlkit.rollout.generation import sampling

    cfg, task, sampler, engines, g = p.cfg, p.task, p.sampler, p.engines, p.cfg.grpo
    if g.streaming:
        stream = GroupStream(task, engines, sampler, sampling(cfg.rollout), g, derive_seed(cfg.seed, "generate"),
                             step, cfg.rollout.max_tokens)
        return stream_from(saved.get("stream"), stream)
    restored = [Generation.restored(s, task.rows) for s in saved.get("generations", [])]
    return StepGenerations(start, engines, task.scorer, g, cfg.rollout.max_tokens, g.steps, restored, step)


def _shards(batch: GRPOBatch, g: Any, seed: int) -> list[Any]:
    """The learners' micro-batches of the step: `micro_batch_size` completions each, padded, or
    packed padding-free up to `max_tokens_per_micro_batch` tokens each."""
    if not g.max_tokens_per_micro_batch:
        return batch.shards(plan_micro_batches(len(batch), g.mini_batches, g.num_learners, g.micro_batch_size, seed))
    lengths = batch.attention_mask.sum(1).tolist()
    plan = plan_token_micro_batches(lengths, g.mini_batches, g.num_learners, g.max_tokens_per_micro_batch, seed)
    return batch.shards(plan, packed=True)


def _log_examples(cfg: GRPOConfig, task: Task, logger: MetricsLogger, step: int, exp: Experience, adv: Any) -> None:
    """At each logging step, `logging.completions` of the step's completions to rollouts.jsonl."""
    n, g = cfg.logging.completions, cfg.grpo
    if n and step % cfg.logging.every == 0:
        names = task.scorer.names + (["overlong_penalty"] if g.overlong_buffer else [])
        logger.log_samples(step, exp.examples(adv, names, g.group_size, n))


def _observe(online: OnlineDifficulty | None, exp: Experience) -> dict[str, float]:
    """Every group the step scored updates the online difficulty; its metrics (none when off)."""
    if online is None:
        return {}
    for row, rewards in exp.groups:
        online.observe(row, rewards)
    return online.metrics()


def _sync_check(cfg: GRPOConfig, task: Task, engines: RolloutEngines, learners: LearnerGroup, step: int,
                due: bool = False) -> dict[str, float]:
    """The parity probe (`rollout.sync_check_every`) after the sync that made policy `step`, when
    it is due: the engines and the learner score the first train and held-out prompts; a
    `FaultError` names an engine that disagrees."""
    from rlkit.grpo.parity import sync_check, sync_check_tol

    every = cfg.rollout.sync_check_every
    if not every or not (due or step % every == 0):
        return {}
    t0 = time.perf_counter()
    probe = task.probe(task.rows[:1] + task.eval_rows[:1])
    when = "at the start" if step == 0 else f"after step {step}"
    tol = sync_check_tol(cfg.rollout, cfg.model, engines.transport, quantized_learner=cfg.finetuning == "qlora")
    largest, mean = sync_check(engines, learners, probe, tol, when)
    return {"sync/check_abs_diff_max": largest, "sync/check_abs_diff_mean": mean,
            "time/sync_check": time.perf_counter() - t0}


def check_packing(cfg: GRPOConfig, device: Any) -> None:
    """Before launch: `grpo.max_tokens_per_micro_batch` packs only a model without layers that carry a state."""
    from rlkit.model.attention import check_packable
    from rlkit.model.facts import model_facts

    if cfg.grpo.max_tokens_per_micro_batch:
        check_packable(model_facts(cfg.model).config, cfg.model.path, "grpo.max_tokens_per_micro_batch",
                       "set it to 0 and size micro-batches with grpo.micro_batch_size (padded rows)")


def check_images(cfg: GRPOConfig) -> None:
    """Before launch, for prompts with images: what does not take them yet is one line."""
    from rlkit.errors import ConfigError

    if cfg.grpo.max_tokens_per_micro_batch:
        raise ConfigError("rows with images are not packed (their pixels follow the padded rows): set it to null "
                          "and size micro-batches with grpo.micro_batch_size", "grpo.max_tokens_per_micro_batch")
    if cfg.distill is not None:
        raise ConfigError("a teacher scores text only so far: distil from prompts without images", "distill")
    if cfg.finetuning != "full" and cfg.rollout.lora_sync == "adapter" and not cfg.model.freeze_vision_tower:
        raise ConfigError("vLLM serves adapters on the language model only, and this recipe trains the vision "
                          "tower's: use rollout.lora_sync: merged", "rollout.lora_sync")


def _step_metrics(fits: list[Any], samples: int, sync: dict[str, float], t0: float, t1: float, t2: float,
                  engine_seconds: dict[int, float], engines: int) -> dict[str, float]:
    """Training metrics (means over ranks and optimizer steps) and the step's timings. The sync
    time is the driver's wait: with max_staleness >= 1 the learner's put of the policy in the object
    store (the engines' loads overlap the next step, whose train time holds any wait for them).
    `rollout/busy_fraction`: the seconds each engine spent generating this step's samples over the
    step's wall time (at most 1), the mean over engines (`_min`: the least busy one); with
    max_staleness >= 1 those samples were generated while the previous step trained, and an engine
    that keeps up with training is near 1."""
    t3 = time.perf_counter()
    steps = [s for fit in fits for s in fit.steps]
    train = {**mean_metrics(steps), "micro_batches": sum(s.micro_batches for s in steps) / max(1, len(steps))}
    ref = max(fit.logprob_seconds for fit in fits)
    gib = sync["bytes"] / 2**30
    busy = {}
    if engine_seconds:  # none for samples restored from a checkpoint
        fractions = [min(1.0, engine_seconds.get(i, 0.0) / (t3 - t0)) for i in range(engines)]
        busy = {"rollout/busy_fraction": sum(fractions) / len(fractions), "rollout/busy_fraction_min": min(fractions)}
    return {**{f"train/{k}": v for k, v in train.items()},
            "time/ref": ref, "time/train": t2 - t1 - ref, "time/sync": t3 - t2, "time/step": t3 - t0,
            "time/sync_share": (t3 - t2) / (t3 - t0), "train/samples_per_s": samples / (t3 - t0),
            "sync/mib": sync["bytes"] / 2**20, "sync/s_per_gib": (t3 - t2) / gib if gib else 0.0, **busy,
            **perf_metrics([fit.steps for fit in fits])}
