"""`--print-config`'s check of an agent program (`rollout.program`): one rollout of the first
train row with the base policy, on one engine in this process, before anything is launched. A
program that crashes, hangs, floods the endpoint or has its requests refused there is one line and
a non-zero exit; one that runs is summed up in a few lines (requests, turns, forks, tool calls,
what it returned, its last answer)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from rlkit import console
from rlkit.errors import UserError


def recipe_notes(cfg: Any, recipe_path: Any) -> list[str]:
    """What `--print-config` adds after a GRPO recipe: its rewards, resolved; with an agent
    program, a dry run of one rollout."""
    from rlkit.grpo import task

    lines = task.recipe_notes(cfg, recipe_path)
    if cfg.rollout.program.on:
        lines += dry_run(cfg, task.recipe_dir(recipe_path))
    return lines


def dry_run(cfg: Any, base_dir: str | None, engine: Any = None) -> list[str]:
    """One rollout of the first train row on `engine` (None: one vLLM engine in this process, as
    `rlkit eval` starts); the lines `--print-config` adds."""
    from rlkit.accel import detect
    from rlkit.agent.program import FAILURES
    from rlkit.grpo.task import load_task
    from rlkit.rollout.generation import sampling
    from rlkit.rollout.local import LocalEngine

    task = load_task(cfg.model, cfg.data, (), None, base_dir, cfg.seed, cfg.rollout,
                     on_cpu=not detect(cfg.device).is_accelerator)
    if not task.rows:
        return []
    quiet = contextlib.nullcontext()
    if engine is None:  # vLLM's start-up and the rollout's own warnings to a log: the outcome is the lines below
        quiet = console.output_to(Path(tempfile.gettempdir()) / f"rlkit-dry-run-{os.getpid()}.log")
    with quiet:
        engine = engine or LocalEngine(cfg)
        try:
            batch = task.agent.generate(task.rows[:1], engine, sampling(cfg.rollout), 1, cfg.seed)
        finally:
            task.agent.close()
    m, s = batch.metrics, batch.samples[0]
    failed = [k for k in FAILURES if m.get(f"program/{k}")]
    if failed:
        why = task.agent.failures.get(failed[0], "")
        raise UserError(f"rollout.program: a dry run of one rollout (row 1 of {cfg.data.train}, the base policy) "
                        f"{failed[0].replace('_', ' ')}: {why}; fix the program, then run again")
    last = next((msg.get("content") for msg in reversed(s.messages or []) if msg.get("role") == "assistant"), "")
    parts = len(s.forks or ()) + 1
    return ["agent program, a dry run of one rollout (row 1, the base policy):",
            f"  {m['program/requests_mean']:.0f} requests, {s.turns} turns, "
            f"{parts - 1} forks, {s.tool_calls} tool calls; it returned {s.env_reward}",
            f"  its last answer: {str(last or '')[:120]!r}"]
