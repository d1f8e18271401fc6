"""What every stage driver shares: inputs checked before launch, the run directory, the
curriculum sampler, and Ray with the learner group.

A stage driver (`sft/run.py`, `grpo/run.py`) loads and checks its data first, then opens its
`RunDir` (config.yaml, atomic checkpoints, what to resume from, metrics) and starts its
learners with `learner_group` (which also starts or joins Ray, and stops what it started).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from rlkit.checkpoint import CheckpointManager, resolve_resume
from rlkit.config import CheckpointConfig, CurriculumConfig, DataConfig, ModelConfig
from rlkit.data.curriculum import CurriculumSampler
from rlkit.recipe import to_dict

log = logging.getLogger("rlkit")
PAYLOAD_FILE = "driver_payload.pt"


def prepare_inputs(model: ModelConfig, data: DataConfig) -> None:
    """Build the offline tiny model / synthetic task where the recipe asks for them and they are
    missing, then check the model path. Runs before Ray starts."""
    from rlkit.models import check_model_path, ensure_tiny_model

    ensure_tiny_model(model)
    check_model_path(model.path)
    if data.synthetic_seed is not None and not Path(data.train).exists():
        from rlkit.tiny import write_task_data

        write_task_data(Path(data.train).parent, seed=data.synthetic_seed)


def curriculum_sampler(curriculum: CurriculumConfig, difficulties: list[str | None], total_steps: int,
                       batch_size: int, seed: int, source: str, row_filter: Any = None) -> CurriculumSampler:
    """The recipe's difficulty schedule over rows with these `difficulty` values (None: no field);
    `row_filter` may skip drawn rows (GRPO's online difficulty)."""
    return CurriculumSampler(difficulties, total_steps, batch_size, seed, curriculum.levels, curriculum.schedule,
                             curriculum.enabled, source=source, row_filter=row_filter)


class RunDir:
    """`output_dir` of one run: the resolved recipe (config.yaml), checkpoints, metrics, final/."""

    def __init__(self, cfg: Any, stage: str):
        self.path = Path(cfg.output_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(
            yaml.safe_dump({"stage": stage, **to_dict(cfg)}, sort_keys=False, allow_unicode=True), encoding="utf-8")
        self.stage, self.config = stage, to_dict(cfg)
        checkpoint: CheckpointConfig = cfg.checkpoint
        self.ckpts = CheckpointManager(self.path / "checkpoints", checkpoint.keep_last)
        self.resume_from = resolve_resume(self.ckpts, checkpoint.resume)

    @property
    def final(self) -> Path:
        return self.path / "final"

    def resume(self, learners: Any, sampler: CurriculumSampler) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint to resume from (if any) into the learners and the sampler; returns
        its step (0 when starting fresh) and the driver state it saved."""
        if self.resume_from is None:
            return 0, {}
        learners.load_checkpoint(self.resume_from)
        saved = CheckpointManager.load_state(self.resume_from)
        sampler.load_state_dict(saved["sampler"])
        log.warning("resumed from %s (step %d)", self.resume_from, saved["step"])
        return saved["step"], saved.get("driver", {})

    def resume_payload(self) -> Any:
        """The driver payload of the checkpoint to resume from (None without one)."""
        if self.resume_from is None or not (self.resume_from / PAYLOAD_FILE).exists():
            return None
        import torch

        return torch.load(self.resume_from / PAYLOAD_FILE, weights_only=True)

    def checkpoint(self, step: int, learners: Any, sampler_state: dict, driver: dict | None = None,
                   protect: set[int] = frozenset(), payload: Any = None) -> None:
        """An atomic checkpoint after `step`: learner states, then the sampler and driver state.
        `sampler_state` is the sampler as the next step will find it; `payload` (plain containers
        of tensors, numbers and strings: e.g. rollouts in flight) goes beside them."""
        staging = self.ckpts.staging_dir(step)
        learners.save_checkpoint(staging)
        if payload is not None:
            import torch

            torch.save(payload, staging / PAYLOAD_FILE)
        self.ckpts.commit(staging, step, {"sampler": sampler_state, **({"driver": driver} if driver else {})},
                          protect)

    def logger(self, logging_cfg: Any, total_steps: int, start_step: int) -> Any:
        """Metrics sinks (JSONL, TensorBoard, wandb, progress); records after `start_step` are dropped."""
        from rlkit.metrics import MetricsLogger

        return MetricsLogger(self.path, logging_cfg, total_steps, start_step=start_step, config=self.config,
                             name=self.stage)


@contextmanager
def learner_group(cfg: Any, spec: Any, num: int, device: Any) -> Iterator[Any]:
    """Start (or join, `ray.address`) Ray and `num` learners; on exit stop the learners and the
    Ray instance if this call started it."""
    from rlkit.engine.group import LearnerGroup
    from rlkit.engine.placement import start_ray

    started_ray = start_ray(cfg.ray, device)
    group = None
    try:
        group = LearnerGroup(spec, num, device, cfg.ray)
        yield group
    finally:
        if group is not None:
            group.shutdown()
        if started_ray:
            import ray

            ray.shutdown()


def learner_spec(cfg: Any, micro_batch_size: int, grad_accum: int, total_steps: int,
                 reference: bool = False) -> Any:
    """The learners' build spec from a stage recipe's shared sections."""
    from rlkit.engine.learner import LearnerSpec

    return LearnerSpec(cfg.model, cfg.finetuning, cfg.lora, cfg.qlora, cfg.optim, cfg.deepspeed, micro_batch_size,
                       grad_accum, total_steps, cfg.seed, cfg.device, reference)
