"""What the tests share (one module: no test module imports another): the checkout's root, the CLI
run as a user runs it, a minimal GRPO recipe, and learners that write checkpoints like the real ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.run.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
TINY_GRPO = ROOT / "recipes" / "tiny-grpo.yaml"


def rlkit_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


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

    return RunDir(stages.load("grpo", TINY_GRPO, [f"output_dir={out}", "checkpoint.every=1", *overrides]), "grpo")
