"""bf16 learners step fp32 master weights in one flat fused optimizer (DeepSpeed's BF16_Optimizer,
not the per-tensor FP16_UnfusedOptimizer), learn, and resume from a checkpoint bit for bit: a
learner in a process of its own (one gloo rank), on the CPU (bf16 kernels run on any CPU, natively
or not, and the optimizer's path is the same as on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r'''
import datetime, json, os, socket, sys, warnings
warnings.filterwarnings("ignore")
import torch, deepspeed
from rlkit.config import DeepSpeedConfig, ModelConfig, OptimConfig
from rlkit.learner.ds_config import skip_shm_comm_op
from rlkit.learner.actor import Learner, LearnerSpec
from rlkit.sft.objective import NLLObjective

model_dir, ckpt, zero = sys.argv[1], sys.argv[2], int(sys.argv[3])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
skip_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=120))

def learner():
    spec = LearnerSpec(ModelConfig(path=model_dir, dtype="bf16"), "full", None, None,
                       OptimConfig(lr=3e-3, scheduler="cosine", warmup_steps=1, max_grad_norm=1.0),
                       DeepSpeedConfig(zero_stage=zero), micro_batch_size=4, grad_accum=2, total_steps=8, seed=0,
                       device="cpu")
    made = Learner(spec, 0, 1)
    made.build()
    return made

gen = torch.Generator().manual_seed(0)
start = torch.randint(4, 40, (16, 1), generator=gen)
rows = 4 + (start - 4 + torch.arange(24)) % 36  # counting rows: learnable in a few steps
batches = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in rows.split(4)]
steps = [batches[:2], batches[2:]]

def run(l, n):
    return [l.train_step(steps[i % 2], NLLObjective()).sums for i in range(n)]

a = learner()
first = run(a, 3)
a.save_checkpoint(ckpt)
after = run(a, 3)
want = {n: p.detach().clone() for n, p in a.engine.module.named_parameters()}
b = learner()
b.load_checkpoint(ckpt)
again = run(b, 3)
got = dict(b.engine.module.named_parameters())
print(json.dumps({
    "optimizer": type(a.engine.optimizer).__name__, "dtypes": sorted({str(p.dtype) for p in want.values()}),
    "nll": [m["nll"] / m["tokens"] for m in first + after], "resumed": [m["nll"] / m["tokens"] for m in again],
    "same": all(torch.equal(got[n], w) for n, w in want.items())}))
'''


def test_a_bf16_learner_steps_one_flat_fp32_optimizer_learns_and_resumes_bit_for_bit(tiny_models, tmp_path):
    """ZeRO-0 (stage 1 with an fp32 gradient accumulation dtype runs the same optimizer)."""
    script = tmp_path / "bf16_learner.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tiny_models["tiny"]), str(tmp_path / "ckpt"), "0"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["optimizer"] == "BF16_Optimizer" and got["dtypes"] == ["torch.bfloat16"], got
    assert got["nll"][-1] < 0.75 * got["nll"][0], got["nll"]  # it learns the counting rows
    assert got["resumed"] == got["nll"][3:], got  # the same losses after the checkpoint, bit for bit
    assert got["same"], "the resumed learner's weights differ from the uninterrupted one's"
