"""What every stage driver shares before and around its training loop: inputs checked before
launch, the curriculum sampler, the learners' spec, and Ray with the learner group.

A stage driver (`sft/run.py`, `grpo/run.py`) loads and checks its data first (`prepare_inputs`
runs the checks every stage shares and the ones the stage hands it), then opens its `RunDir`
(`rlkit.run.rundir`) and starts its learners with `learner_group` (which also starts or joins Ray,
checks the stage's demands on the cluster, and stops what it started). Nothing here knows a stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.actors.cluster import Demand
from rlkit.config import CurriculumConfig
from rlkit.data.curriculum import CurriculumSampler
from rlkit.errors import UserError

if TYPE_CHECKING:
    from rlkit.learner.group import LearnerGroup
    from rlkit.rollout.engines import RolloutEngines

log = logging.getLogger("rlkit")


def prepare_inputs(cfg: Any, device: Any, memory: Any, checks: Sequence[Callable[[Any, Any], None]] = (),
                   learners: int = 1) -> Any:
    """Check the precision against the device, import a GGUF model (`rlkit.model.gguf`), build the
    offline tiny model / synthetic task where the recipe asks for them and they are missing, check
    the model (and tokenizer) path, the DeepSpeed section (and warn of ZeRO-3 on one of the
    `learners`), the stage's own `checks` (each called
    with the config and the device; GRPO's: the distillation teacher) and, on an accelerator, the
    estimate against the device (`memory`: the stage's `rlkit.estimate.memory.MemoryModel`).
    Runs before Ray starts; returns the config the run uses: a GGUF path is its HF folder there,
    and every path is absolute (`rlkit.paths`: actors work in their raylet's folder)."""
    from rlkit.accel import check_precision
    from rlkit.estimate import check_before_launch
    from rlkit.learner.ds_config import check_deepspeed_config, zero3_alone
    from rlkit.model.checks import check_model, ensure_tiny_model
    from rlkit.model.facts import model_facts
    from rlkit.model.gguf import resolve_models
    from rlkit.model.kernels import check_kernels
    from rlkit.paths import with_absolute_paths
    from rlkit.tiny import ensure_task_data
    from rlkit.tiny_vlm import write_shape_task

    cfg = resolve_models(cfg)
    check_precision(cfg.model.dtype, device)
    if cfg.qlora is not None:
        check_precision(cfg.qlora.compute_dtype, device, "qlora.compute_dtype")
    ensure_tiny_model(cfg.model)
    check_model(cfg)
    check_deepspeed_config(cfg.deepspeed, cfg.optim)
    check_kernels(cfg.model, device, model_facts(cfg.model).model_type)
    alone = zero3_alone(cfg.deepspeed, learners)
    if alone:
        log.warning("%s", alone)
    for check in checks:
        check(cfg, device)
    too_big = check_before_launch(cfg, memory, device)
    if too_big and cfg.memory_check == "error":
        raise UserError(f"{too_big}; memory_check: warn launches it anyway")
    if too_big:
        log.warning("%s", too_big)
    ensure_task_data(cfg.data, write_shape_task)
    return with_absolute_paths(cfg)


def devices_line(device: Any, learners: int, engines: int = 0, tp: int = 1, colocate: bool = False) -> str:
    """How many devices (CPU: processes) the learners and engines take."""
    def count(n: int, what: str) -> str:
        plural = {"CPU process": "CPU processes"}.get(what, what + "s")
        return f"{n} {what if n == 1 else plural}"

    unit = "CPU process" if not device.is_accelerator else f"{device.kind} device"
    if not engines:
        return f"{count(learners, unit)} ({count(learners, 'learner')})"
    if colocate:
        return f"{count(learners, unit)} (each holds a learner and its engine)"
    return (f"{count(learners + engines * tp, unit)} ({count(learners, 'learner')} + {count(engines, 'engine')} "
            f"x tensor_parallel_size {tp})")


def curriculum_sampler(curriculum: CurriculumConfig, difficulties: list[str | None], total_steps: int,
                       batch_size: int, seed: int, source: str, row_filter: Any = None) -> CurriculumSampler:
    """The recipe's difficulty schedule over rows with these `difficulty` values (None: no field);
    `row_filter` may skip drawn rows (GRPO's online difficulty)."""
    return CurriculumSampler(difficulties, total_steps, batch_size, seed, curriculum.levels, curriculum.schedule,
                             curriculum.enabled, source=source, row_filter=row_filter)


@contextmanager
def learner_group(cfg: Any, spec: Any, num: int, device: Any, demands: Sequence[Demand],
                  started: Callable[[], None] | None = None) -> Iterator[LearnerGroup]:
    """Start (or join, `ray.address`) Ray and `num` learners; on exit stop the learners and the
    Ray instance if this call started it. `demands`: all the run will ask of the cluster (the
    learners' `learner_demand` and the stage's own: engines, a teacher, reward actors), checked
    before anything starts; `started`: the stage's own check once Ray is up (GRPO: the teacher's node)."""
    from rlkit.actors.cluster import check_resources
    from rlkit.actors.placement import start_ray, stop_ray
    from rlkit.learner.group import LearnerGroup

    started_ray = start_ray(cfg.ray, device, Path(cfg.output_dir) / "logs")
    group = None
    try:
        check_resources(list(demands))
        if started is not None:
            started()
        group = LearnerGroup(spec, num, device, cfg.ray, Path(cfg.output_dir))
        yield group
    finally:
        if group is not None:
            group.shutdown()
        if started_ray:
            stop_ray()


def learner_demand(cfg: Any, num_learners: int, device: Any, key: str) -> Demand:
    """The learners' bundles on the Ray cluster (`key`: the recipe key that sets their number)."""
    from rlkit.actors.placement import bundle

    custom = cfg.ray.resources
    return Demand("learner", num_learners, bundle(device, cfg.ray.cpus_per_actor, custom=custom.learner),
                  cfg.ray.placement, key, tuple(custom.learner))


def memory_metrics(learners: LearnerGroup, engines: RolloutEngines | None = None) -> dict[str, float]:
    """The processes' memory (GiB): `memory/learner_peak_gib`, the largest rank's peak (device
    memory allocated on an accelerator, resident memory on a CPU), and `memory/learner_model_gib`,
    that peak less the process before its model was built (what `rlkit estimate` models); the
    same for separate rollout engines (`memory/engine_*`)."""
    out: dict[str, float] = {}
    for kind, reports in (("learner", learners.memory()), ("engine", engines.memory() if engines else [])):
        peaks = [(r["now"].get("device_peak", r["now"].get("rss_peak", 0)),
                  r["base"].get("device_peak", r["base"].get("rss", 0))) for r in reports if r.get("now")]
        if peaks:
            out[f"memory/{kind}_peak_gib"] = max(p for p, _ in peaks) / 2**30
            out[f"memory/{kind}_model_gib"] = max(p - b for p, b in peaks) / 2**30
    return out


def learner_spec(cfg: Any, micro_batch_size: int, grad_accum: int, total_steps: int,
                 reference: bool = False, teacher: Any = None, head: str = "lm") -> Any:
    """The learners' build spec from a stage recipe's shared sections."""
    from rlkit.learner.actor import LearnerSpec

    return LearnerSpec(model=cfg.model, finetuning=cfg.finetuning, lora=cfg.lora, qlora=cfg.qlora, optim=cfg.optim,
                       deepspeed=cfg.deepspeed, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                       total_steps=total_steps, seed=cfg.seed, device=cfg.device, reference=reference, teacher=teacher,
                       head=head)
