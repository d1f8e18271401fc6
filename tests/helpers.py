"""What the tests share (one module: no test module imports another): the checkout's root, the CLI
run as a user runs it, the recipe overrides of tiny SFT and GRPO runs and their metrics' readers,
a minimal GRPO recipe, scripts/tool_task.py as a module, and learners that write checkpoints like
the real ones."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.run.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
GRPO_RECIPE = ROOT / "recipes" / "tiny-grpo.yaml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rlkit_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def sft_overrides(tiny_model, task_data, out_dir, *extra: str) -> list[str]:
    """A tiny SFT run's overrides: the model and task given, no builds, quiet."""
    return [f"model.path={tiny_model}", "model.build_tiny_if_missing=null", f"data.train={task_data['sft_train']}",
            f"data.eval={task_data['sft_eval']}", "data.build_synthetic_if_missing=null", f"output_dir={out_dir}",
            "logging.progress=none", "logging.tensorboard=false", *extra]


def pair_overrides(model, task_data, out, *extra: str) -> list[str]:
    """A tiny run's overrides on the task's preference pairs (`rlkit dpo`, `rm`, `kto`): the model
    and pairs given, quiet."""
    return [f"model.path={model}", f"data.train={task_data['dpo_train']}", f"data.eval={task_data['dpo_eval']}",
            "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
            "logging.tensorboard=false", *extra]


def greedy_exact(model_dir, rows) -> float:
    """The share of the task's rows a model folder answers with the bare number, greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.data.templates import render_alpaca

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    hits = 0
    for r in rows:
        ids = tokenizer(render_alpaca(r["instruction"], r["input"]), return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        hits += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == r["output"]
    return hits / len(rows)


def trainable_grads(model) -> dict:
    """Each trainable parameter's gradient, named without peft's `base_model.model.` prefix."""
    return {n.removeprefix("base_model.model."): p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_grads(model, want: dict) -> None:
    """`model`'s gradients are `want`'s (`trainable_grads` of a peer's model), parameter by parameter."""
    import torch

    grads = trainable_grads(model)
    assert grads.keys() == want.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-4, msg=name)


def perturb_lora_b(model) -> None:
    """LoRA's B matrices set away from 0 (seeded by name): the adapted policy then differs from
    its reference, the base model with the adapter disabled."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)


def grpo_overrides(model, task_data, out, *extra: str) -> list[str]:
    """A tiny GRPO run's overrides: one engine and one learner unless a test asks for more (the
    recipe itself runs 2 + 2), the model and task given, quiet."""
    return ["rollout.num_engines=1", "grpo.num_learners=1", "deepspeed.zero_stage=0",
            f"model.path={model}", f"data.train={task_data['grpo_train']}", f"data.eval={task_data['grpo_eval']}",
            "data.build_synthetic_if_missing=null", f"output_dir={out}", "logging.progress=none",
            "logging.tensorboard=false",
            *extra]


def run_metrics(run) -> list[dict]:
    """Every record of a run's metrics.jsonl."""
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def eval_losses(run) -> list[float]:
    """An SFT run's held-out losses, in order."""
    return [r["eval/loss"] for r in run_metrics(run) if r.get("eval/loss") is not None]


def run_steps(run) -> list[dict]:
    """A GRPO run's training-step records (eval.every 0 still evaluates before the first step)."""
    return [r for r in run_metrics(run) if "reward/mean" in r]


def logged_steps(run) -> int:
    """The last step in a running GRPO run's metrics (0 before any, or while a line is half written)."""
    try:
        return max([r["step"] for r in run_steps(run)], default=0)
    except (OSError, ValueError):
        return 0


def first_rows(path: Path, n: int, out: Path) -> Path:
    """The first `n` rows of a JSONL file, written to `out` (a small pool the sampler revisits)."""
    out.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    return out


def tool_task_script() -> ModuleType:
    """scripts/tool_task.py as a module: the tests run the calculator task through it."""
    spec = importlib.util.spec_from_file_location("tool_task", ROOT / "scripts" / "tool_task.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


GRPO_BASE = ("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
             "rewards: [{fn: 'rewards.exact:exact_match'}]\n")


# seed 002's ZeRO-3 on NPU, as Hugging Face's Trainer users write it: "auto" nearly everywhere
SEED_002 = {
    "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True}}


class FakeLearners:
    """Writes like the learners do: `nbytes` of tensors per checkpoint or final model."""

    def __init__(self, nbytes: int, fail: Exception | None = None):
        self.nbytes, self.fail = nbytes, fail

    def save_checkpoint(self, staging: Path) -> None:
        import torch

        if self.fail:
            raise self.fail
        torch.save({"w": torch.zeros(self.nbytes // 4)}, Path(staging) / "mp_rank_00_model_states.pt")

    def save_model(self, out: Path, tokenizer_dir: str) -> None:
        import torch

        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.zeros(self.nbytes // 4)}, Path(out) / "model.pt")


def grpo_run_dir(out: Path, *overrides: str) -> RunDir:
    """The run directory of the tiny GRPO recipe in `out`, checkpointing every step."""
    from rlkit import stages
    from rlkit.run.rundir import RunDir

    return RunDir(stages.load("grpo", GRPO_RECIPE, [f"output_dir={out}", "checkpoint.every=1", *overrides]), "grpo")
