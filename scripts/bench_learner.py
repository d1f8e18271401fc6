"""The learner's step against a bare PyTorch loop: same model, batch, precision and device.

    python scripts/bench_learner.py                                  # 25m model, 4 x 512, fp32, CPU
    python scripts/bench_learner.py --model smollm2 --steps 3 --warmup 1 --repeat 1
    python scripts/bench_learner.py --model qwen2.5-1.5b --dtype bf16 --batch 8 --seq 1024   # a GPU host

Rows (`--rows`, comma-separated; each runs in a fresh process, `--repeat` times in alternating order):
  bare        a twenty-line loop: fp32 weights, bf16 autocast (`--dtype bf16`), the model's own
              loss (`labels`), torch's fused AdamW, `zero_grad(set_to_none=True)`.
  liger       the same with Liger's kernels (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE);
              CUDA with liger-kernel installed only.
  forward     a bare no-grad forward in the training precision, the logprobs of the completion
              tokens from the model's own logits: what the reference scoring is held to.
  sft-zK      rlkit's `Learner` (DeepSpeed, ZeRO stage K, one rank) stepping the SFT objective.
  grpo-zK     the same with the GRPO objective on the same tokens (the first quarter of each row
              a prompt, the rest its completion): the reference's and the old policy's logprobs
              attached (`Learner.logprobs`, timed apart: ref, old), KL beta 0.04, the engine's
              logprobs for the rollout correction, entropy logged.
  sft-zKx2    two ranks (gloo on a CPU), each with half the batch: ZeRO's multi-rank path.
  NAME-all    bare, liger or sft-zK with every token labelled: the like-for-like rows. Elsewhere
              the labels are the last three quarters; rlkit's head projects only those positions
              through the lm_head, the bare loop's `labels=` loss all of them, so those rows do
              less work than the bare loop and their ratio to it flatters rlkit.

Model (`--model`): 25m or tiny (`rlkit.tiny`), smollm2 (SmolLM2-135M-Instruct from its package,
as `bench_grpo.py --model`), qwen2.5-1.5b (Qwen2.5-1.5B's shape, untied as R1-Distill-1.5B, with
random weights built from its config: no download), or an HF folder. Tokens are random ids of
the vocabulary; every row is `--seq` tokens; SFT's labels and GRPO's completion are the last
three quarters, so both score the same positions (every token in the -all rows).

What is printed: per row the step's median, min and max over the timed steps of all its runs
(after `--warmup` steps in each run), tokens/s (all input tokens), MFU (`rlkit.learner.perf`:
3 x forward FLOPs, the lm_head counted on the positions the row projects; against the device's
dense peak, or on a CPU the measured matrix-product rate of one process in that precision; a
two-rank row against two of them), peak memory (CUDA: torch's peak allocation; CPU: the process's
peak resident set), and the ratio to the bare loop's median step (an -all row: to bare-all's), with
`=` after the ratio where the two rows do the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import SPREAD_HEADER, free_port, machine, run_spawned, run_spawned_together, spread, spread_cells  # noqa: E402

SHAPES = {"qwen2.5-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"}
BETA = 0.04


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="25m", help="25m, tiny, smollm2, qwen2.5-1.5b or an HF model folder")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--batch", type=int, default=4, help="rows per step (one micro-batch)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per run")
    p.add_argument("--repeat", type=int, default=2, help="runs per row, in alternating order")
    p.add_argument("--rows", default=None, help="rows to run (default: every row the device has)")
    p.add_argument("--layers", type=int, default=0, help="cut a built shape to this many layers (a smoke test)")
    p.add_argument("--workdir", default=None, help="keep the built model here (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write every timing here")
    return p.parse_args(argv)


def default_rows(device: str) -> list[str]:
    rows = ["bare"] + (["liger"] if device == "cuda" else []) + ["forward"]
    rows += [f"sft-z{z}" for z in range(4)] + [f"grpo-z{z}" for z in (0, 2)]
    like = ["bare-all", "liger-all", "sft-z0-all", "sft-z1-all", "sft-z2-all"] if device == "cuda" else \
        ["bare-all", "sft-z0-all"]
    return rows + (["sft-z0x2", "sft-z3x2"] if device == "cpu" else []) + like


def every_token(batch: dict) -> dict:
    """`batch` with every token labelled (the -all rows)."""
    return {**batch, "labels": batch["input_ids"].clone()}


def head_positions(name: str, batch: dict) -> int:
    """The positions a row projects through the lm_head: the bare loop's loss every position (its
    logits), rlkit's head the scored ones only (the labels' or the completion's, shifted)."""
    if name.split("-")[0] in ("bare", "liger", "forward"):  # the model's logits, then a selection
        return batch["input_ids"].numel()
    if name.endswith("-all"):
        return batch["input_ids"][:, 1:].numel()
    return int((batch["labels"][:, 1:] != -100).sum())


# ------------------------------------------------------------------ the model and the batch


def model_dir(spec: str, work: Path, layers: int) -> Path:
    if spec in ("25m", "tiny"):
        from rlkit.tiny import build_tiny_model

        out = work / f"model-{spec}"
        return out if (out / "config.json").exists() else build_tiny_model(out, spec)
    if spec in SHAPES:
        return build_shape(spec, work / f"model-{spec}-{layers or 'all'}", layers)
    if spec in ("smollm2", "gemma3-270m") or spec.endswith(".gguf"):
        from rlkit.gsm8k import real_model
        from rlkit.model.gguf import import_gguf, is_gguf

        path = real_model(spec)
        return import_gguf(path) if is_gguf(path) else path
    if not (Path(spec) / "config.json").is_file():
        sys.exit(f"--model {spec}: not 25m, tiny, smollm2, {', '.join(SHAPES)} or an HF folder")
    return Path(spec)


def build_shape(spec: str, out: Path, layers: int) -> Path:
    """A published model's shape with random weights (bf16 safetensors), built once into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlkit.estimate import PUBLISHED

    if (out / "config.json").exists():
        return out
    fields = dict(PUBLISHED[SHAPES[spec]])
    if layers:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, Any]:
    """Random ids; the last three quarters of each row are SFT labels and GRPO's completion."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=gen)
    completion = (torch.arange(seq) >= seq // 4).long().expand(rows, seq).clone()
    labels = ids.masked_fill(completion == 0, -100)
    advantages = torch.randn(rows, generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "completion_mask": completion, "advantages": advantages}


# ------------------------------------------------------------------ rows (each in its own process)


def _timed(fn: Any, steps: int, warmup: int, sync: Any) -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def _peak(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def _setup(device: str) -> tuple[Any, Any]:
    import logging
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return torch, sync


def row_bare(path: str, device: str, dtype: str, batch: dict, steps: int, warmup: int, liger: bool,
             forward_only: bool = False) -> dict[str, Any]:
    torch, sync = _setup(device)
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    data = {k: v.to(device) for k, v in batch.items()}
    autocast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    if forward_only:
        model = model.to(torch.bfloat16) if dtype == "bf16" else model
        where = data["completion_mask"][:, 1:].bool()

        @torch.no_grad()
        def step():
            logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits[:, :-1]
            logp = logits[where].float().log_softmax(-1).gather(-1, data["input_ids"][:, 1:][where][:, None])
            return logp.sum().item()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            with autocast:
                loss = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                             labels=data["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return {"step": _timed(step, steps, warmup, sync), "peak_gib": _peak(device)}


def _learner(path: str, device: str, dtype: str, zero: int, rows: int, reference: bool, rank: int = 0,
             world: int = 1, port: int = 0) -> Any:
    import datetime

    import deepspeed

    from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig
    from rlkit.learner.actor import Learner, LearnerSpec

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port or free_port()))
    spec = LearnerSpec(ModelConfig(path=path, dtype=dtype, attn_implementation="sdpa"), "full", None, None,
                       OptimConfig(lr=1e-5, scheduler="constant", max_grad_norm=1.0),
                       DeepSpeedConfig(zero_stage=zero), micro_batch_size=rows, grad_accum=1, total_steps=10**6,
                       seed=0, device=device, reference=reference)
    learner = Learner(spec, rank, world)
    if device == "cpu":
        from rlkit.learner.ds_config import skip_shm_comm_op

        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=600))
    learner.build()
    return learner


def row_sft(path: str, device: str, dtype: str, zero: int, batch: dict, steps: int, warmup: int, rank: int = 0,
            world: int = 1, port: int = 0) -> dict[str, Any]:
    torch, sync = _setup(device)
    from rlkit.learner.objective import MicroBatch
    from rlkit.sft.objective import NLLObjective

    rows = len(batch["input_ids"]) // world
    mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()
            if k in ("input_ids", "attention_mask", "labels")}
    learner = _learner(path, device, dtype, zero, rows, False, rank, world, port)
    mb, objective = MicroBatch(mine), NLLObjective()
    times = _timed(lambda: learner.train_step([mb], objective), steps, warmup, sync)
    return {"step": times, "peak_gib": _peak(device)}


def row_grpo(path: str, device: str, dtype: str, zero: int, batch: dict, steps: int, warmup: int) -> dict[str, Any]:
    torch, sync = _setup(device)
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.learner.objective import MicroBatch, step_normaliser
    from rlkit.rollout.config import RolloutConfig

    rows = len(batch["input_ids"])
    learner = _learner(path, device, dtype, zero, rows, True)
    objective = GRPOObjective.from_config(GRPOAlgoConfig(beta=BETA, mini_batches=2, micro_batch_size=rows),
                                          RolloutConfig(temperature=1.0))
    tokens = int(batch["completion_mask"][:, 1:].sum())
    mb = MicroBatch({k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask", "advantages")} |
                    {"num_items_in_batch": torch.tensor(step_normaliser(tokens, 1, 1), dtype=torch.float64)})
    where = objective.positions
    engine = learner.logprobs([mb], 1.0, "policy", where)[0]
    mb = MicroBatch({**mb, "engine_logp": engine + 0.01 * torch.randn_like(engine) * mb["completion_mask"][:, 1:]})
    scored: dict[str, Any] = {}

    def score(key: str, model: str) -> None:
        scored[key] = learner.logprobs([mb], 1.0, model, where)[0]

    ref = _timed(lambda: score("ref_logp", "reference"), steps, warmup, sync)
    old = _timed(lambda: score("old_logp", "policy"), steps, warmup, sync)
    attached = mb.attach("ref_logp", scored["ref_logp"]).attach("old_logp", scored["old_logp"])
    train = _timed(lambda: learner.train_step([attached], objective), steps, warmup, sync)
    return {"step": train, "ref": ref, "old": old, "peak_gib": _peak(device)}


def run_row(name: str, path: str, device: str, dtype: str, batch: dict, steps: int, warmup: int) -> dict[str, Any]:
    """One row's timings, in fresh processes (two for a two-rank row)."""
    if name.endswith("-all"):
        name, batch = name[:-len("-all")], every_token(batch)
    if name in ("bare", "liger", "forward"):
        return run_spawned(row_bare, path, device, dtype, batch, steps, warmup, name == "liger", name == "forward")
    kind, zero = name.split("-z")
    if zero.endswith("x2"):
        port, z = free_port(), int(zero[0])
        both = run_spawned_together(*[(row_sft, path, device, dtype, z, batch, steps, warmup, r, 2, port)
                                      for r in range(2)])
        return {"step": [max(a, b) for a, b in zip(both[0]["step"], both[1]["step"])],
                "peak_gib": max(r["peak_gib"] for r in both)}
    fn = row_sft if kind == "sft" else row_grpo
    return run_spawned(fn, path, device, dtype, int(zero), batch, steps, warmup)


# ------------------------------------------------------------------ the table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rlkit.accel import detect
    from rlkit.estimate import Arch, config_json
    from rlkit.learner.perf import forward_flops, peak_flops, train_flops

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    rows = args.rows.split(",") if args.rows else default_rows(device)
    if {"liger", "liger-all"} & set(rows) and device != "cuda":
        sys.exit("--rows liger: Liger's kernels are Triton kernels for a CUDA device")
    started = time.perf_counter()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-learner-")
    work = Path(args.workdir or tmp.name)
    try:
        path = model_dir(args.model, work, args.layers)
        arch = Arch.from_config(*config_json(str(path)))
        batch = make_batch(arch.vocab, args.batch, args.seq)
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
        for rep in range(args.repeat):
            for name in rows if rep % 2 == 0 else rows[::-1]:
                runs[name].append(run_row(name, str(path), device, args.dtype, batch, args.steps, args.warmup))
        info = detect(device)
        peak = peak_flops(info, args.dtype, seconds=3.0)
        lengths = [args.seq] * args.batch
        flops = {"train": train_flops(arch, lengths), "score": forward_flops(arch, lengths),
                 "head_position": 2 * arch.hidden * arch.vocab, "tokens": args.batch * args.seq,
                 "positions": {name: head_positions(name, batch) for name in rows}}
        report(args, path, arch, info, peak, flops, runs, time.perf_counter() - started)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "peak_flops": peak,
                                                   "flops": flops}, indent=1), encoding="utf-8")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def report(args: argparse.Namespace, path: Path, arch: Any, info: Any, peak: float, flops: dict[str, float],
           runs: dict[str, list[dict[str, Any]]], seconds: float) -> None:
    what = "the measured GEMM rate of one process" if not info.is_accelerator else "the dense peak"
    where = machine() if info.kind == "cpu" else info.kind
    print(f"model {args.model} ({arch.params / 1e6:.1f}M params, vocabulary {arch.vocab}), {args.dtype}, "
          f"{args.batch} x {args.seq} tokens, device {info.device_name} ({where}), {args.steps} timed steps after "
          f"{args.warmup} per run, {args.repeat} runs a row, {seconds:.0f} s")
    print(f"MFU against {what}: {peak / 1e12:.3f} TFLOP/s {args.dtype}; a step computes "
          f"{flops['train'] / 1e12:.3f} TFLOP (3 x forward, the lm_head on every position), a scoring "
          f"{flops['score'] / 1e12:.3f}; like for like (=): the -all rows against bare-all (every token "
          f"labelled); the other rows label the last 3/4, which rlkit's head alone projects")
    tokens = args.batch * args.seq
    print(f"{'row':<14}{'part':<7}{SPREAD_HEADER}{'tokens/s':>10}{'MFU':>7}{'peak GiB':>10}{'/ bare':>9}")
    for name, rs in runs.items():
        base = "bare-all" if name.endswith("-all") else "bare"
        bare = spread([t for r in runs.get(base, []) for t in r["step"]])["median"]
        parts = ("step", "ref", "old") if name.startswith("grpo") else ("step",)
        for part in parts:
            s = spread([t for r in rs for t in r[part]])
            mfu = row_flops(name, part, flops) / s["median"] / peak / (2 if name.endswith("x2") else 1)
            same = "=" if name.endswith("-all") else ""
            ratio = f"{s['median'] / bare:.2f}x{same}" if bare == bare and part == "step" else "-"
            peak_gib = f"{max(r['peak_gib'] for r in rs):.2f}" if part == "step" else "-"
            print(f"{name:<14}{part:<7}{spread_cells(s)}{tokens / s['median']:>10.0f}{100 * mfu:>6.1f}%"
                  f"{peak_gib:>10}{ratio:>9}")


def row_flops(name: str, part: str, flops: dict[str, Any]) -> float:
    """What a row's `part` computes: a training step 3 x its forward, a scoring 1 x, the lm_head on
    the positions the row projects (`head_positions`) rather than on every one."""
    times = 3 if part == "step" and name != "forward" else 1
    full = flops["train"] if times == 3 else flops["score"]
    skipped = flops["tokens"] - flops["positions"].get(name, flops["tokens"])
    return full - times * flops["head_position"] * skipped


if __name__ == "__main__":
    raise SystemExit(main())
