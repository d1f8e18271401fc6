"""Rollout engines as a group, and one step's experience: generate -> score -> advantages."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.accel import DeviceInfo
from rlkit.config import GRPOConfig
from rlkit.grpo.advantages import frac_zero_std, get_advantage, zero_std_mask
from rlkit.grpo.batch import Rollout
from rlkit.grpo.loss import soft_overlong_penalty


def engine_kwargs(cfg: GRPOConfig, device: DeviceInfo, index: int) -> dict[str, Any]:
    """`RolloutWorker` arguments of engine `index`, separate or colocated alike."""
    r = cfg.rollout
    return dict(dtype="float32" if cfg.model.dtype == "fp32" else "auto", seed=cfg.seed + index,
                max_model_len=r.max_model_len, gpu_memory_utilization=r.gpu_memory_utilization,
                kv_cache_gib=None if device.is_accelerator else r.kv_cache_gb)


class RolloutGroup:
    """`rollout.num_engines` vLLM engines in Ray actors; prompts are split contiguously.

    Separate (default): each engine in its own actor and placement-group bundle. Colocated
    (`RolloutGroup.colocated`): the engines live inside the learner actors, one per rank.
    """

    colocated_with: Any = None  # the LearnerGroup hosting the engines, when colocated

    @classmethod
    def colocated(cls, learners: Any, cfg: GRPOConfig, model_path: str, device: DeviceInfo) -> RolloutGroup:
        """Start one engine inside each learner process (`Learner.start_rollout`)."""
        learners.call_each("start_rollout", [
            (model_path, {**engine_kwargs(cfg, device, rank), "sleep_mode": cfg.rollout.sleep})
            for rank in range(len(learners.actors))])
        group = cls.__new__(cls)
        group.engines, group.pg, group.colocated_with = list(learners.actors), None, learners
        return group

    def __init__(self, cfg: GRPOConfig, model_path: str, device: DeviceInfo):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.engine.group import actor_resources, placement_group, worker_env
        from rlkit.engine.rollout import create_rollout_actor

        r = cfg.rollout
        tp = r.tensor_parallel_size
        # One bundle per engine with its tp devices (or tp x CPUs: one process per TP rank),
        # apart from the learners' bundles; vLLM runs its TP workers inside the actor.
        cpus = cfg.ray.cpus_per_actor * (1 if device.is_accelerator else tp)
        opts = actor_resources(device, cpus, devices=tp)
        resources = {"CPU": opts["num_cpus"], **({"GPU": opts["num_gpus"]} if "num_gpus" in opts else {}),
                     **opts.get("resources", {})}
        self.pg = placement_group(device, r.num_engines, cpus, devices=tp)
        self.engines = [
            create_rollout_actor(
                model_path, resources=resources, env_vars=worker_env(device),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
                tensor_parallel_size=tp, **engine_kwargs(cfg, device, i))
            for i in range(r.num_engines)]
        ray.get([e.ready.remote() for e in self.engines])

    def generate_async(self, prompts: list[str], n: int, seed: int, cfg: GRPOConfig,
                       temperature: float | None = None) -> list[Any]:
        """Start generating `n` samples per prompt (at `rollout.temperature` unless given);
        returns Ray futures for `gather`."""
        r, k = cfg.rollout, len(self.engines)
        temperature = r.temperature if temperature is None else temperature
        size = -(-len(prompts) // k)
        shards = [prompts[i * size:(i + 1) * size] for i in range(k)]
        return [e.generate.remote(s, n=n, temperature=temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                  stop=list(r.stop) or None, seed=seed * 131 + i)
                for i, (e, s) in enumerate(zip(self.engines, shards)) if s]

    @staticmethod
    def gather(futures: list[Any]) -> list[Any]:
        """Samples of `generate_async`, prompt-major."""
        import ray

        return [s for part in ray.get(futures) for s in part]

    def generate(self, prompts: list[str], n: int, seed: int, cfg: GRPOConfig,
                 temperature: float | None = None) -> list[Any]:
        """`n` samples per prompt, prompt-major, reproducible for `seed`."""
        return self.gather(self.generate_async(prompts, n, seed, cfg, temperature))

    def idle(self) -> None:
        """Generation is over until the next sync: colocated engines on an accelerator sleep
        (vLLM sleep mode) so the learners get the device memory back."""
        if self.colocated_with is not None:
            self.colocated_with.call("sleep_rollout")

    def shutdown(self) -> None:
        import ray

        if self.colocated_with is not None:
            return  # the learner group owns the actors
        for e in self.engines:
            ray.kill(e)
        ray.util.remove_placement_group(self.pg)


@dataclass
class Experience:
    rollouts: list[Rollout] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def score_rows(scorer: Any, rows: list[dict], prompts: list[str], samples: list[Any], n: int) -> Any:
    """Score `n` samples per row (prompt-major); the rows' columns go to the rewards as kwargs."""
    expand = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    columns = {k: expand([row.get(k) for row in rows]) for k in rows[0] if k != "prompt"}
    return scorer.score(expand(prompts), [s.text for s in samples], [s.token_ids for s in samples], columns)


def score_samples(rows: list[dict], prompts: list[str], samples: list[Any], scorer: Any,
                  cfg: GRPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards [N] (weighted sum, plus the soft overlong penalty when on) and reward metrics."""
    result = score_rows(scorer, rows, prompts, samples, cfg.grpo.group_size)
    rewards = torch.tensor(result.total, dtype=torch.float32)
    metrics = result.metrics("reward")
    if cfg.grpo.overlong_buffer:
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
        penalty = soft_overlong_penalty(lengths, cfg.rollout.max_tokens, cfg.grpo.overlong_buffer,
                                        cfg.grpo.overlong_penalty)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    return rewards, metrics


@dataclass
class Pending:
    """Generation in flight for one step (see `launch`)."""

    rows: list[dict]
    prompts: list[str]
    futures: list[Any]
    started: float
    sampler_state: dict | None = None  # the sampler before these rows were drawn (for checkpoints)


def launch(rows: list[dict], render: Any, engines: RolloutGroup, cfg: GRPOConfig, step: int, attempt: int = 0,
           sampler_state: dict | None = None) -> Pending:
    """Start generating G completions for each row; returns at once."""
    prompts = [render(r) for r in rows]
    futures = engines.generate_async(prompts, cfg.grpo.group_size, seed=step * 1000 + attempt, cfg=cfg)
    return Pending(rows, prompts, futures, time.perf_counter(), sampler_state)


def finish(pending: Pending, more_rows: Any, render: Any, engines: RolloutGroup, scorer: Any, cfg: GRPOConfig,
           step: int) -> Experience:
    """Wait for `pending`, score, and assemble `prompts_per_step` groups. With dynamic sampling
    (DAPO), groups whose rewards are all equal are dropped and more prompts (`more_rows()`) are
    generated, up to `max_refill_rounds`; if still short, dropped groups fill the gap (they carry
    zero advantage)."""
    G, want = cfg.grpo.group_size, cfg.grpo.prompts_per_step
    kept: list[tuple[list[Rollout], torch.Tensor]] = []
    spare: list[tuple[list[Rollout], torch.Tensor]] = []
    t_gen = t_rew = 0.0
    first_metrics: dict[str, float] = {}
    lengths: list[int] = []
    truncated = 0
    rounds = 1 + (cfg.grpo.max_refill_rounds if cfg.grpo.dynamic_sampling else 0)
    for attempt in range(rounds):
        if attempt:
            pending = launch(more_rows(), render, engines, cfg, step, attempt)
        samples = engines.gather(pending.futures)
        t1 = time.perf_counter()
        rewards, metrics = score_samples(pending.rows, pending.prompts, samples, scorer, cfg)
        t_gen, t_rew = t_gen + t1 - pending.started, t_rew + time.perf_counter() - t1
        if attempt == 0:
            first_metrics = {**metrics, "frac_zero_std": frac_zero_std(rewards, G)}
            lengths = [len(s.token_ids) for s in samples]
            truncated = sum(s.finish_reason == "length" for s in samples)
        zero = zero_std_mask(rewards, G)
        for g in range(len(pending.rows)):
            group = [Rollout(s.prompt_token_ids, s.token_ids, s.finish_reason == "length", s.logprobs)
                     for s in samples[g * G:(g + 1) * G]]
            target = spare if (cfg.grpo.dynamic_sampling and bool(zero[g])) else kept
            target.append((group, rewards[g * G:(g + 1) * G]))
        if len(kept) >= want:
            break
    chosen = (kept + spare)[:want]
    exp = Experience()
    for group, r in chosen:
        exp.rollouts.extend(group)
        exp.rewards.extend(r.tolist())
    n_tokens = sum(lengths)
    exp.metrics = {**first_metrics, "completion/len_mean": n_tokens / max(len(lengths), 1),
                   "completion/len_max": float(max(lengths, default=0)),
                   "completion/truncated_frac": truncated / max(len(lengths), 1),
                   "time/generate": t_gen, "time/reward": t_rew,
                   "generate_tokens_per_s": n_tokens / max(t_gen, 1e-9),
                   "dynamic_sampling/kept_groups": float(min(len(kept), want))}
    return exp


def advantages(rewards: list[float], cfg: GRPOConfig) -> torch.Tensor:
    fn = get_advantage(cfg.grpo.advantage)
    return fn(torch.tensor(rewards, dtype=torch.float32), cfg.grpo.group_size, eps=cfg.grpo.advantage_eps,
              std="sample")
