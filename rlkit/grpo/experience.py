"""One step's experience: generate G completions per prompt -> score -> (refill) -> advantages;
and the held-out evaluation. Generation runs on the rollout engines (`rollout/engines.py`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlkit.agent.loop import rollout_metrics
from rlkit.grpo.advantages import frac_zero_std, get_advantage, normalize_then_sum, soft_overlong_penalty, zero_std_mask
from rlkit.grpo.batch import Rollout
from rlkit.grpo.config import GRPOAlgoConfig
from rlkit.grpo.task import Task
from rlkit.rollout.samples import Sample, Sampling

if TYPE_CHECKING:
    from rlkit.rollout.engines import RolloutEngines


@dataclass
class Generation:
    """Generation in flight for one step's prompt rows (see `start_generation`)."""

    rows: list[dict]
    prompts: list[str]
    futures: list[Any]
    engines: RolloutEngines
    started: float
    version: int = 0  # the policy version (optimizer steps synced into the engines) that generates
    samples: list[Sample] | None = None  # once gathered (or restored from a checkpoint)
    indices: list[int] = field(default_factory=list)  # the rows' indices in the task's train rows
    multi_turn: bool = False  # futures: one future of an `AgentBatch` (rlkit.agent.loop)
    agent: Any = None  # the AgentBatch, once gathered

    def wait(self) -> list[Sample]:
        """The samples, prompt-major (G per row)."""
        if self.samples is None and self.multi_turn:
            self.agent = self.futures[0].result()
            self.samples = self.agent.samples
        elif self.samples is None:
            self.samples = self.engines.gather(self.futures)
        return self.samples

    def prompt_texts(self, n: int) -> list[str]:
        """The prompt of each of the samples as the model saw it (`n` samples per row)."""
        return self.agent.prompt_texts if self.agent is not None else [p for p in self.prompts for _ in range(n)]

    @property
    def resumable(self) -> bool:
        """Whether a checkpoint can hold it: not when its rollouts' environment instances (live
        objects the rewards see) are part of it."""
        return self.agent is None or self.agent.environments is None

    def engine_seconds(self) -> dict[int, float]:
        """Seconds each engine (by index) spent generating these samples, once gathered (none for a
        generation restored from a checkpoint)."""
        if self.agent is not None:
            return dict(self.agent.busy)
        busy: dict[int, float] = {}
        for call in self.futures:
            if getattr(call, "seconds", None) is not None:
                busy[call.index] = busy.get(call.index, 0.0) + call.seconds
        return busy

    def state_dict(self) -> dict[str, Any]:
        """Waits for the samples; everything needed to score and train on them after a restart."""
        samples = self.wait()
        agent = self.agent and {"prompts": self.agent.prompts, "prompt_texts": self.agent.prompt_texts,
                                "returned": self.agent.returned}
        rows = [{k: v for k, v in r.items() if not _has_image_object(v)} for r in self.rows]  # plain containers
        return {"rows": rows, "prompts": self.prompts, "version": self.version, "indices": self.indices,
                "samples": [dataclasses.asdict(s) for s in samples], "agent": agent}

    @classmethod
    def restored(cls, state: dict[str, Any], train_rows: list[dict] | None = None) -> Generation:
        """A finished generation from `state_dict`; its rows are the task's `train_rows` at its
        indices when given (a row's images, which the checkpoint does not hold as objects)."""
        from rlkit.agent.loop import AgentBatch

        samples = [restored_sample(s) for s in state["samples"]]
        agent = state.get("agent")
        indices = state.get("indices") or []
        rows = [train_rows[i] for i in indices] if train_rows is not None and indices else state["rows"]
        return cls(rows, state["prompts"], [], None, time.perf_counter(), version=state["version"],
                   samples=samples, indices=state.get("indices", []),
                   agent=agent and AgentBatch(samples, agent["prompts"], agent["prompt_texts"], None,
                                              returned=agent.get("returned", False)))


def restored_sample(state: dict[str, Any]) -> Sample:
    """A sample from `dataclasses.asdict` (its forks too)."""
    forks = state.get("forks")
    return Sample(**{**state, "forks": forks and [restored_sample(f) for f in forks]})


def _has_image_object(value: Any) -> bool:
    """Whether a row's value is (or lists) an image object (a PIL image from a datasets column),
    which a checkpoint's plain containers do not hold."""
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, (list, tuple)) and any(
        isinstance(v, Image.Image) for v in value))


@dataclass
class Experience:
    rollouts: list[Rollout] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # weighted totals [N]
    per_fn: list[list[float]] = field(default_factory=list)  # [N][K] per reward function, NaN = None
    weights: list[float] = field(default_factory=list)  # [K]
    metrics: dict[str, float] = field(default_factory=dict)
    groups: list[tuple[int, list[float]]] = field(default_factory=list)  # (row index, G rewards): every group scored
    texts: list[tuple[str, str]] = field(default_factory=list)  # (rendered prompt, completion) per rollout
    engine_seconds: dict[int, float] = field(default_factory=dict)  # engine index -> seconds generating them

    def examples(self, advantages: torch.Tensor, names: list[str], group_size: int, n: int) -> list[dict[str, Any]]:
        """`n` completions for rollouts.jsonl (one from each group in turn): prompt, completion,
        total reward, each function's reward (None where it gave none), advantage, length, whether
        it was cut at max_tokens."""
        groups = max(1, len(self.rollouts) // group_size)
        picks = [(i % groups) * group_size + i // groups for i in range(min(n, len(self.rollouts)))]
        return [{"prompt": self.texts[i][0], "completion": self.texts[i][1], "reward": self.rewards[i],
                 "rewards": {name: (None if math.isnan(v) else v) for name, v in zip(names, self.per_fn[i])},
                 "advantage": float(advantages[i]), "tokens": len(self.rollouts[i].completion_ids),
                 "truncated": self.rollouts[i].truncated} for i in picks]


def start_generation(indices: list[int], task: Task, engines: RolloutEngines, sampling: Sampling, group_size: int,
                     seed: int, version: int = 0) -> Generation:
    """Start generating `group_size` completions for each of the train rows `indices` with the
    engines' policy `version`; returns at once."""
    rows = [task.rows[i] for i in indices]
    prompts = [task.render(r) for r in rows]
    if task.agent is not None:  # multi-turn: the turn loop runs in a driver thread
        future = task.agent.background.start(task.agent.generate, rows, engines, sampling, group_size, seed)
        return Generation(rows, prompts, [future], engines, time.perf_counter(), version=version,
                          indices=list(indices), multi_turn=True)
    futures = engines.generate_async(task.engine_prompts(rows, prompts), group_size, sampling, seed)
    return Generation(rows, prompts, futures, engines, time.perf_counter(), version=version, indices=list(indices))


def score_rows(scorer: Any, rows: list[dict], prompts: list[str], samples: list[Sample], n: int,
               agent: Any = None) -> Any:
    """Score `n` samples per row (prompt-major); the rows' columns go to the rewards as kwargs.

    As TRL's GRPOTrainer: a row whose prompt is a message list (chat data) gives the rewards
    that list and the completion as ``[{"role": "assistant", "content": text}]``; a text row
    its rendered prompt and the text. `prompts` (rendered) also go as ``prompt_texts``. A
    multi-turn generation (`agent`, an AgentBatch) gives each sample's prompt messages, its turns
    as messages (assistant and tool) and, with environments, ``environments=`` (the instances)."""
    expand = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    columns = {k: expand([row.get(k) for row in rows]) for k in rows[0] if k != "prompt"}
    if agent is not None:
        if agent.environments is not None:
            columns["environments"] = agent.environments
        if agent.environments is not None or agent.returned:  # an interaction's or an agent program's rewards
            columns["env_rewards"] = [s.env_reward for s in samples]
        return scorer.score(agent.prompts, [s.text if s.messages is None else s.messages for s in samples],
                            [s.token_ids for s in samples], columns, prompt_texts=agent.prompt_texts)
    chat = [isinstance(row.get("prompt"), list) for row in rows]
    shown = [row["prompt"] if c else p for row, p, c in zip(rows, prompts, chat)]
    completions = [[{"role": "assistant", "content": s.text}] if chat[i // n] else s.text
                   for i, s in enumerate(samples)]
    return scorer.score(expand(shown), completions, [s.token_ids for s in samples], columns,
                        prompt_texts=expand(prompts))


def score_samples(generation: Generation, samples: list[Sample], scorer: Any, algo: GRPOAlgoConfig,
                  max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[float], dict[str, float]]:
    """Rewards [N] (weighted sum, plus the soft overlong penalty when on), the rewards per
    function [N, K] (NaN where one gave None; the penalty is a last column of weight 1), the
    weights [K], and reward metrics."""
    result = score_rows(scorer, generation.rows, generation.prompts, samples, algo.group_size, generation.agent)
    if generation.agent is not None:
        generation.agent.release()
    rewards = torch.tensor(result.total, dtype=torch.float32)
    columns = [[float("nan") if v is None else float(v) for v in result.per_fn[name]] for name in scorer.names]
    weights = [r.spec.weight for r in scorer.rewards]
    metrics = result.metrics("reward")
    if algo.overlong_buffer:
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
        penalty = soft_overlong_penalty(lengths, max_tokens, algo.overlong_buffer, algo.overlong_penalty)
        rewards = rewards + penalty
        columns.append(penalty.tolist())
        weights.append(1.0)
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    per_fn = torch.tensor(columns, dtype=torch.float32).T.reshape(len(samples), len(columns))
    return rewards, per_fn, weights, metrics


def collect(generation: Generation, refill: Callable[[int], Generation], scorer: Any, algo: GRPOAlgoConfig,
            max_tokens: int, algo_step: int | None = None) -> Experience:
    """Wait for `generation`, score it and assemble `prompts_per_step` groups. With dynamic
    sampling (DAPO) groups whose rewards are all equal are set aside and `refill(attempt)` starts
    generating for more rows, up to `max_refill_rounds`; if still short, set-aside groups fill the
    gap (they carry zero advantage). Metrics describe the first generation; with `algo_step` (the
    policy version that trains on them) also the staleness of the rollouts kept."""
    G, want = algo.group_size, algo.prompts_per_step
    kept: list[tuple[list[Rollout], torch.Tensor, torch.Tensor, list[tuple[str, str]]]] = []
    spare: list[tuple[list[Rollout], torch.Tensor, torch.Tensor, list[tuple[str, str]]]] = []
    weights: list[float] = []
    scored: list[tuple[int, list[float]]] = []
    t_gen = t_rew = 0.0
    first: dict[str, float] = {}
    busy: dict[int, float] = {}
    rounds = 1 + (algo.max_refill_rounds if algo.dynamic_sampling else 0)
    for attempt in range(rounds):
        if attempt:
            generation = refill(attempt)
        samples = generation.wait()
        for engine, seconds in generation.engine_seconds().items():
            busy[engine] = busy.get(engine, 0.0) + seconds
        t1 = time.perf_counter()
        rewards, per_fn, weights, metrics = score_samples(generation, samples, scorer, algo, max_tokens)
        t_gen, t_rew = t_gen + t1 - generation.started, t_rew + time.perf_counter() - t1
        if attempt == 0:
            first = {**metrics, **completion_metrics(samples), "reward/frac_zero_std": frac_zero_std(rewards, G)}
            if generation.agent is not None:
                first.update(rollout_metrics(samples, generation.agent.tool_seconds))
                first.update(generation.agent.metrics)
        zero = zero_std_mask(rewards, G)
        shown = generation.prompt_texts(G)
        scored += [(i, rewards[g * G:(g + 1) * G].tolist()) for g, i in enumerate(generation.indices)]
        for g in range(len(generation.rows)):
            images = tuple(generation.rows[g].get("images") or ())
            group = [rollout_of(s, generation.version, images) for s in samples[g * G:(g + 1) * G]]
            texts = [(shown[k], samples[k].text) for k in range(g * G, (g + 1) * G)]
            (spare if algo.dynamic_sampling and bool(zero[g]) else kept).append(
                (group, rewards[g * G:(g + 1) * G], per_fn[g * G:(g + 1) * G], texts))
        if len(kept) >= want:
            break
    exp = Experience(weights=weights, groups=scored, engine_seconds=busy)
    for group, r, per, texts in (kept + spare)[:want]:
        exp.rollouts.extend(group)
        exp.texts.extend(texts)
        exp.rewards.extend(r.tolist())
        exp.per_fn.extend(per.tolist())
    n_tokens = first.pop("completion/tokens")
    lags = [algo_step - r.policy_version for r in exp.rollouts] if algo_step is not None else [0]
    exp.metrics = {**first, "staleness/lag_mean": sum(lags) / max(len(lags), 1), "staleness/lag_max": float(max(lags)),
                   "time/generate": t_gen, "time/reward": t_rew,
                   "rollout/tokens_per_s": n_tokens / max(t_gen, 1e-9),
                   "dynamic_sampling/kept_groups": float(min(len(kept), want))}
    return exp


def rollout_of(s: Sample, version: int, images: tuple) -> Rollout:
    """What the driver keeps of a sample (and of its forks); `version`: its oldest token's policy."""
    forks = tuple(rollout_of(f, version, images) for f in s.forks or ())
    return Rollout(s.prompt_token_ids, s.token_ids, s.finish_reason == "length", s.logprobs, version, s.tool_mask,
                   images, forks, tuple(s.versions or ()))


def completion_metrics(samples: list[Sample]) -> dict[str, float]:
    """Lengths in the model's own tokens (a multi-turn completion's tool results not counted, as TRL)."""
    lengths = [len(s.token_ids) if s.tool_mask is None else sum(s.tool_mask) for s in samples]
    n = max(len(lengths), 1)
    return {"completion/tokens": float(sum(lengths)), "completion/len_mean": sum(lengths) / n,
            "completion/len_max": float(max(lengths, default=0)),
            "completion/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n}


def advantages(exp: Experience, algo: GRPOAlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The recipe's advantages over the step's rewards (groups contiguous), and metrics: the
    registered estimator on the weighted totals, or GDPO's per-function normalisation."""
    if algo.multi_objective_aggregation == "normalize_then_sum":
        adv = normalize_then_sum(torch.tensor(exp.per_fn, dtype=torch.float32), torch.tensor(exp.weights),
                                 algo.group_size, eps=algo.advantage_eps)
    else:
        adv = get_advantage(algo.advantage)(torch.tensor(exp.rewards, dtype=torch.float32), algo.group_size,
                                            eps=algo.advantage_eps, std="sample")
    return adv, {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()),
                 "advantage/abs_mean": float(adv.abs().mean())}


@dataclass
class Evaluation:
    """Completions of held-out rows and their rewards (`evaluate_rows`)."""

    rows: list[dict]
    prompts: list[str]  # rendered
    samples: list[Sample]  # prompt-major, `n` per row
    n: int
    result: Any  # RewardResult

    def metrics(self) -> dict[str, float]:
        """`eval/reward` (mean total reward) and `eval/<fn>` (the mean of each reward function, e.g.
        exact-answer accuracy), over non-None values (NaN where a function gave none)."""
        means = self.result.metrics("eval")
        return {"eval/reward": means["eval/mean"],
                **{f"eval/{name}": means[f"eval/{name}/mean"] for name in self.result.per_fn}}

    def row_means(self, name: str, rows: list[int] | None = None) -> list[float]:
        """The mean of reward function `name` over each row's samples, for the rows (indices) given
        (default: all) that have a value."""
        values = self.result.per_fn[name]
        out = []
        for i in range(len(self.rows)) if rows is None else rows:
            got = [v for v in values[i * self.n:(i + 1) * self.n] if v is not None]
            if got:
                out.append(sum(got) / len(got))
        return out

    def mean(self, name: str, rows: list[int] | None = None) -> float:
        """The mean of `row_means` (NaN for none)."""
        means = self.row_means(name, rows)
        return sum(means) / len(means) if means else math.nan

    def stderr(self, name: str, rows: list[int] | None = None) -> float:
        """The standard error of `mean`: the sample std of the row means / sqrt(rows) (NaN below 2 rows)."""
        means = self.row_means(name, rows)
        if len(means) < 2:
            return math.nan
        mu = sum(means) / len(means)
        return math.sqrt(sum((m - mu) ** 2 for m in means) / (len(means) - 1) / len(means))

    def pass_at(self, name: str, k: int, threshold: float = 1.0) -> float:
        """pass@k of reward function `name`: the chance that at least one of k samples of a row
        scores >= `threshold`, unbiased from the row's n samples (Chen et al. 2021), averaged over rows."""
        values = self.result.per_fn[name]
        total = 0.0
        for i in range(len(self.rows)):
            right = sum(v is not None and v >= threshold for v in values[i * self.n:(i + 1) * self.n])
            total += 1.0 - (math.comb(self.n - right, k) / math.comb(self.n, k) if self.n - right >= k else 0.0)
        return total / max(1, len(self.rows))


def evaluate_rows(task: Task, rows: list[dict], engines: RolloutEngines, sampling: Sampling, n: int,
                  seed: int) -> Evaluation:
    """`n` seeded completions of each row from `engines` (anything with `generate(prompts, n,
    sampling, seed)` and `idle()`), scored by the task's rewards: the GRPO held-out eval and
    `rlkit eval` alike."""
    prompts = [task.render(r) for r in rows]
    if task.agent is not None:
        batch = task.agent.generate(rows, engines, sampling, n, seed)
        samples, prompts = batch.samples, batch.prompt_texts[::n]
        result = score_rows(task.scorer, rows, prompts, samples, n, batch)
        batch.release()
    else:
        samples = engines.generate(task.engine_prompts(rows, prompts), n, sampling, seed)
        result = score_rows(task.scorer, rows, prompts, samples, n)
    engines.idle()
    return Evaluation(rows, prompts, samples, n, result)


def evaluate(task: Task, engines: RolloutEngines, sampling: Sampling, samples_per_prompt: int,
             seed: int) -> dict[str, float]:
    """The held-out rows' `eval/reward` and `eval/<fn>` (see `Evaluation.metrics`)."""
    return evaluate_rows(task, task.eval_rows, engines, sampling, samples_per_prompt, seed).metrics()
