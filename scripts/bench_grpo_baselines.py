"""The baselines `bench_grpo.py` measures rlkit against, each run in a spawned process: the bare
parts (rlkit's `RolloutWorker.generate` in-process; a plain torch GRPO training step) and TRL's
`GRPOTrainer` on the same model, prompts and update (see bench_grpo.py's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import keep_going, meet, spread

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TRL_MODES = ("generate", "cb", "colocate")
EPS_LOW, EPS_HIGH = 0.2, 0.28  # the DAPO clip of every side


def prompt_rows(data: Path, n: int, template: str, model_dir: str) -> list[dict[str, Any]]:
    """The first `n` prompt rows, rendered as rlkit renders them (`template`: alpaca, or auto: the
    model's chat template): {prompt, answer}."""
    from transformers import AutoTokenizer

    from rlkit.data.formats import load_prompts
    from rlkit.data.templates import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir) if template != "alpaca" else None
    rows = load_prompts(str(data)).rows
    return [{"prompt": render_prompt(r, template, tokenizer), "answer": r["answer"]} for r in rows[:n]]


# ---------------------------------------------------------------- bare baselines


def phase_bare_generate(args: argparse.Namespace, model_dir: str, data: str, samples_out: str,
                        steps: int | None = None, barrier: str | None = None) -> dict[str, Any]:
    """Time `RolloutWorker.generate` in this process (`steps` calls, default --steps; after `meet`
    at `barrier`); save the completions for the bare train."""
    from rlkit.rollout.worker import cpu_engine_env

    os.environ.update(cpu_engine_env(1.0, int(os.environ["OMP_NUM_THREADS"])))  # before vLLM's import
    from rlkit.rollout.worker import RolloutWorker

    steps = steps or args.steps
    rows = prompt_rows(Path(data), args.prompts * steps, args.template, model_dir)
    worker = RolloutWorker(model_dir, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype], seed=args.seed,
                           max_model_len=max(128, args.prompt_len + args.max_tokens), kv_cache_gib=1.0)
    times, lengths, batches, spans = [], [], [], []
    meet(barrier)
    step = 0
    while keep_going(barrier, step, steps):
        at = step % steps
        prompts = [r["prompt"] for r in rows[at * args.prompts:(at + 1) * args.prompts]]
        t0, wall = time.perf_counter(), time.time()
        samples = worker.generate(prompts, n=args.group, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens,
                                  seed=step)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            spans.append((wall, wall + dt))
            lengths += [len(s.token_ids) for s in samples]
        if step < steps:
            batches.append([[s.prompt_token_ids, s.token_ids] for s in samples])
        step += 1
    worker.shutdown()
    Path(samples_out).write_text(json.dumps(batches))
    return {"generate_steps": times, "lengths": lengths, "spans": spans}


def phase_bare_train(args: argparse.Namespace, model_dir: str, samples_in: str,
                     barrier: str | None = None) -> dict[str, Any]:
    """Time plain-torch GRPO optimizer steps (no Ray, no DeepSpeed; the learner's attention) on the
    bare completions (after `meet` at `barrier`)."""
    from contextlib import nullcontext

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.grpo.batch import GRPOBatch, Rollout, plan_micro_batches, plan_token_micro_batches
    from rlkit.grpo.loss import policy_loss
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.model.attention import use_packed_attention

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(args.seed)
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_attention(model)  # the learner's attention: per sequence in packed rows, sdpa when padded
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)  # as the learner
    batches = json.loads(Path(samples_in).read_text())
    times, spans = [], []
    meet(barrier)
    step = 0
    while keep_going(barrier, step, len(batches)):
        samples = batches[step % len(batches)]
        t0, wall = time.perf_counter(), time.time()
        rollouts = [Rollout(p, c, False) for p, c in samples]
        batch = GRPOBatch.collate(rollouts, torch.randn(len(rollouts)), pad)
        tokens = max(batch.completion_tokens(), 1)
        budget = args.max_tokens_per_micro_batch
        index = (plan_token_micro_batches(batch.attention_mask.sum(1).tolist(), 1, 1, budget, args.seed + step)
                 if budget else plan_micro_batches(len(rollouts), 1, 1, args.micro_batch, args.seed + step))[0][0]
        for rows in index:
            mb = batch.packed_micro_batch(rows) if budget else batch.micro_batch(rows)
            with torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext():
                logp, entropy = token_logprobs(model, mb, 1.0, with_entropy=True,
                                               positions=mb["completion_mask"][:, 1:].bool())
            out = policy_loss(logp, None, mb["advantages"], mb["completion_mask"][:, 1:].float(),
                              epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo",
                              num_items_in_batch=tokens, entropies=entropy)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            spans.append((wall, wall + times[-1]))
        step += 1
    return {"train_steps": times, "spans": spans}


def summarise_bare(generate: list[dict[str, Any]], train: list[dict[str, Any]],
                   together: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The bare parts alone, and (async) each while the other runs in a second process: only the
    steps that lie wholly inside the time both ran count."""
    gen = [t for run in generate for t in run["generate_steps"]]
    steps = [t for run in train for t in run["train_steps"]]
    lengths = [n for run in generate for n in run["lengths"]]
    out = {"generate": spread(gen), "train": spread(steps), "completion/len_mean": statistics.fmean(lengths),
           "generate_steps": gen, "train_steps": steps}
    if together:
        inside = {"generate": [], "train": []}
        for pair in together:
            start, end = max(r["spans"][0][0] for r in pair), min(r["spans"][-1][1] for r in pair)
            for key, run in zip(("generate", "train"), pair):
                inside[key] += [b - a for a, b in run["spans"] if start <= a and b <= end]
        out.update(generate_together=spread(inside["generate"]), train_together=spread(inside["train"]))
    return out


# ---------------------------------------------------------------- TRL


def phase_trl(args: argparse.Namespace, model_dir: str, data: str, out: str) -> dict[str, Any]:
    import logging

    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    from trl import GRPOConfig, GRPOTrainer

    from rewards.exact import number_close

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stamps: list[float] = []
    logs: list[dict[str, float]] = []
    gen_times: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs_: dict | None = None, **kw: Any) -> None:
            logs.append(dict(kw.get("logs") or logs_ or {}))

    rows = args.prompts * args.group
    mode = args.trl_mode
    extra: dict[str, Any] = {}
    if mode == "cb":
        extra["use_transformers_continuous_batching"] = True
    elif mode == "colocate":
        extra.update(use_vllm=True, vllm_mode="colocate",
                     vllm_max_model_length=max(128, args.prompt_len + args.max_tokens),
                     vllm_gpu_memory_utilization=0.1)
    trl_args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch, generation_batch_size=rows,
        num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, loss_type="dapo", epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
        bf16=args.dtype == "bf16", fp16=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, seed=args.seed, disable_tqdm=True, shuffle_dataset=False, **extra)
    dataset = Dataset.from_list(prompt_rows(Path(data), args.prompts * args.steps, args.template, model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=number_close, args=trl_args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Stamp()])
    trainer.remove_callback(PrinterCallback)
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **kw: Any) -> Any:  # generation + reward + batch assembly, per step
        t0 = time.perf_counter()
        out = generate_and_score(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    if len(stamps) != args.steps:
        raise RuntimeError(f"TRL ran {len(stamps)} steps, expected {args.steps}")
    step_logs = [r for r in logs if "completions/mean_length" in r]
    steps = [b - a for a, b in zip(stamps[args.warmup - 1:], stamps[args.warmup:])]
    return {"steps": steps, "generate_steps": gen_times[args.warmup:],
            "lengths": [r["completions/mean_length"] for r in step_logs[args.warmup:]], "wall_s": total, "mode": mode}


def summarise_trl(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [t for run in runs for t in run["steps"]]
    generate = [t for run in runs for t in run["generate_steps"]]
    return {"spread": spread(steps), "time/generate": statistics.median(generate),
            "completion/len_mean": statistics.fmean([n for run in runs for n in run["lengths"]]),
            "wall_s": [run["wall_s"] for run in runs], "mode": runs[0]["mode"], "steps": steps}
