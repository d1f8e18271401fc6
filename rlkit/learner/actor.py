"""The policy learner: one DeepSpeed engine per rank, run inside a Ray actor (see `group.py`).

It knows no stage: SFT and GRPO hand it an `Objective` (objective.py) and micro-batches (dicts
of CPU tensors). Ranks form a torch.distributed group (gloo on CPU, nccl/hccl on accelerators,
from the device layer). It also scores tokens (policy or frozen reference) and pushes its weights
to rollout engines; what it writes and reads back is `saving.py`'s, the colocated vLLM engine it
can host `colocate.py`'s (their methods are the actor's too).
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkit import faults
from rlkit.config import DeepSpeedConfig, LoraConfig, ModelConfig, OptimConfig, QuantConfig
from rlkit.learner.objective import LOGPROB_SOURCES, FitResult, MicroBatch, Objective, StepMetrics, accumulate
from rlkit.learner.saving import Saving
from rlkit.sync.colocate import ColocatedEngine, EngineHost
from rlkit.transports import SyncRequest


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a rank needs to build its engine (sent once to each actor)."""

    model: ModelConfig
    finetuning: str
    lora: LoraConfig | None
    qlora: QuantConfig | None
    optim: OptimConfig
    deepspeed: DeepSpeedConfig
    micro_batch_size: int
    grad_accum: int
    total_steps: int  # optimizer steps, for the lr schedule
    seed: int
    device: str = "auto"
    reference: bool = False  # also hold the frozen starting policy (for KL terms)
    teacher: ModelConfig | None = None  # also hold a frozen teacher (on-policy distillation)
    head: str = "lm"  # the model's end: the lm_head, or one score (a reward model: `rlkit.model.load.HEADS`)


class Learner(EngineHost, Saving):
    """One rank. Create, then `init_process_group` on every rank at once, then `build`."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int):
        from rlkit.accel import apply_env, configure_cpu_threads, detect
        from rlkit.actors.reaper import exit_when_cut_off
        from rlkit.console import name_worker_log

        name_worker_log(f"learner-{rank}")
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.device_info = detect(spec.device)
        apply_env(self.device_info)
        if not self.device_info.is_accelerator:
            configure_cpu_threads()
        self.engine: Any = None
        self.reference: Any = None
        self.teacher: Any = None
        self.clips = False
        self._ds_hf_config: Any = None  # keeps HfDeepSpeedConfig alive for ZeRO-3 loading
        self._transports: dict[str, Any] = {}  # persistent transports (a broadcast group), opened on first push
        self.colocated: ColocatedEngine | None = None  # see start_engine
        exit_when_cut_off(spec.deepspeed.dist_timeout_s, f"learner {rank}")

    # ------------------------------------------------------------------ setup

    def address(self) -> tuple[str, int]:
        """(node address, free port) of this actor, for rank 0 to host the process group."""
        from rlkit.actors.cluster import rendezvous

        return rendezvous()

    def init_process_group(self, master: tuple[str, int]) -> None:
        """Join the learners' process group that rank 0 hosts at `master` (its `address`)."""
        import deepspeed
        import ray

        from rlkit.actors.cluster import interface_env

        backend, ifname = self.device_info.dist_backend, self.device_info.socket_ifname_var
        master_addr, master_port = master
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), **interface_env(ifname))
        bound = os.environ.get(ifname)
        print(f"rlkit: learner rank {self.rank} of {self.world_size} on node {ray.util.get_node_ip_address()}: "
              f"{backend} process group at {master_addr}:{master_port}" + (f", on {bound}" if bound else ""),
              flush=True)  # to the actor's log
        if not self.device_info.is_accelerator:
            from rlkit.learner.ds_config import skip_shm_comm_op

            skip_shm_comm_op()
        try:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                       timeout=datetime.timedelta(seconds=self.spec.deepspeed.dist_timeout_s))
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError / gloo's connect errors
            from rlkit.errors import UserError

            reason = " ".join(str(e).split())[:300]
            raise UserError(f"learner rank {self.rank} on node {ray.util.get_node_ip_address()} could not join the "
                            f"{backend} process group at {master_addr}:{master_port}: {reason}. The learners' "
                            f"nodes must reach each other there (firewall; {ifname} names the interface to use)"
                            ) from None

    def build(self) -> dict[str, Any]:
        """Load the model, wrap it (LoRA/QLoRA), create the DeepSpeed engine (and the reference).
        Returns a summary."""
        import deepspeed

        from rlkit.accel import memory_now
        from rlkit.learner.ds_config import deepspeed_config, learner_clips, lr_lambda
        from rlkit.learner.logprobs import frozen_models
        from rlkit.learner.perf import Throughput
        from rlkit.model import load
        from rlkit.model.kernels import apply_kernels
        from rlkit.seeding import seed_everything

        spec = self.spec
        self.base_memory = memory_now(self.device_info)  # before the model: what the estimate does not model
        seed_everything(spec.seed)
        dtype = load.resolve_dtype(spec.model.dtype, self.device_info.bf16 and self.device_info.is_accelerator)
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        ds_cfg = deepspeed_config(spec.deepspeed, spec.optim, precision, spec.micro_batch_size,
                                  spec.grad_accum, self.world_size)
        if spec.deepspeed.zero_stage == 3 and spec.finetuning == "full":
            from transformers.integrations import HfDeepSpeedConfig

            self._ds_hf_config = HfDeepSpeedConfig(ds_cfg)  # every rank loads: partitioned on load
        load_dtype = torch.float32 if precision != "fp32" and spec.finetuning == "full" else dtype
        model = load.load_model(spec.model, load_dtype, spec.qlora if spec.finetuning == "qlora" else None,
                                spec.head)
        apply_kernels(model, spec.model.kernels, self.device_info.kind)
        model = load.wrap_for_training(model, spec.finetuning, spec.lora, spec.model, spec.head)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None
        if spec.deepspeed.torch_adam:  # torch's fused kernel where it has one (CPU: 3x the per-tensor loop)
            optimizer = torch.optim.AdamW(params, lr=spec.optim.lr, betas=spec.optim.betas, eps=spec.optim.eps,
                                          weight_decay=spec.optim.weight_decay,
                                          fused=self.device_info.fused_adamw or None)
        schedule = lr_lambda(spec.optim, spec.total_steps)
        # A callable: DeepSpeed builds it on the unwrapped optimizer, steps it at each accumulation
        # boundary and saves it in checkpoints.
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, config=ds_cfg,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.clips = learner_clips(spec.deepspeed, precision)
        adapters = sum(p.numel() for p in params if p.ndim == 2) if spec.finetuning in ("lora", "qlora") else None
        self.throughput = Throughput(model.config.to_dict(), self.device_info, precision, adapters)
        if self.world_size == 1 and (spec.deepspeed.zero_stage == 0 or spec.deepspeed.flat_bf16(precision)):
            # One rank: nothing to reduce, but DeepSpeed would still flatten, all-reduce and copy
            # back every gradient at each step (~8% of a 25M-parameter step on CPU).
            self.engine.enable_backward_allreduce = False
        self.reference, self.teacher = frozen_models(spec, self.engine, self.device_info)
        trainable, total = load.trainable_summary(model)
        return {"trainable_params": trainable, "total_params": total, "precision": precision,
                "device": self.device_info.kind, "zero_stage": spec.deepspeed.zero_stage}

    def memory(self) -> dict[str, dict[str, int]]:
        """This rank's memory (bytes) before the model was built and now, peaks included."""
        from rlkit.accel import memory_now

        return {"base": getattr(self, "base_memory", {}), "now": memory_now(self.device_info)}

    # ------------------------------------------------------------------ training

    def train_step(self, micro_batches: list[MicroBatch], objective: Objective) -> StepMetrics:
        """One optimizer step over k micro-batches (`grad_accum`, or as many as a token budget made:
        every rank gets the same k); each micro-batch's loss is `objective(model, micro_batch) / k`."""
        faults.crash_here("train_step", f"learner{self.rank}")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        t0 = time.perf_counter()
        self.engine.train()
        sums: dict[str, float] = {}
        norm = None
        k = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            loss, metrics = objective(self.engine, self._to_device(mb), **self._frozen(objective))
            self.engine.set_gradient_accumulation_boundary(i == k - 1)  # the optimizer steps after the k-th
            self.engine.backward(loss / k, scale_wrt_gas=False)
            if i == k - 1:
                norm = self._grad_norm_before_step()
            self.engine.step()
            for key, value in metrics.items():
                accumulate(sums, key, float(value))
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        return StepMetrics(sums, len(micro_batches), float(norm) if norm is not None else float("nan"),
                           float(self.engine.lr_scheduler.get_last_lr()[0]), **self.throughput.step(micro_batches, t0))

    def fit(self, steps: list[list[MicroBatch]], objective: Objective, epochs: int = 1) -> FitResult:
        """Attach the logprobs `objective.needs` to every micro-batch (before any update), then run
        `epochs` passes of the optimizer steps `steps` (each `grad_accum` micro-batches). The
        batch arrives once; only metrics go back."""
        faults.crash_here("fit", f"learner{self.rank}")
        t0 = time.perf_counter()
        micro = [MicroBatch.of(mb) for step in steps for mb in step]
        for key in objective.needs:
            scored = self.logprobs(micro, objective.temperature, LOGPROB_SOURCES[key], objective.positions)
            micro = [mb.attach(key, logp) for mb, logp in zip(micro, scored)]
        starts = list(itertools.accumulate((len(step) for step in steps), initial=0))
        steps = [micro[a:b] for a, b in itertools.pairwise(starts)]
        seconds = time.perf_counter() - t0
        return FitResult([self.train_step(step, objective) for _ in range(epochs) for step in steps], seconds)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch], objective: Objective) -> dict[str, float]:
        """Sums of the objective's metrics over micro-batches (with the logprobs it `needs` attached),
        without gradients."""
        micro = [MicroBatch.of(mb) for mb in micro_batches]
        for key in objective.needs:
            scored = self.logprobs(micro, objective.temperature, LOGPROB_SOURCES[key], objective.positions)
            micro = [mb.attach(key, logp) for mb, logp in zip(micro, scored)]
        self.engine.eval()
        sums: dict[str, float] = {}
        for mb in micro:
            _, metrics = objective(self.engine, self._to_device(mb), **self._frozen(objective))
            for key, value in metrics.items():
                accumulate(sums, key, float(value))
        return sums

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch], temperature: float = 1.0, model: str = "policy",
                 positions: Callable[[MicroBatch], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Token logprobs [B, L-1] (CPU) per micro-batch under the current policy or the frozen
        `"reference"` (see `learner/logprobs.py`), at `positions(micro_batch)` (default: all)."""
        from rlkit.learner.logprobs import token_logprobs

        if model == "reference" and self.reference is None:
            raise RuntimeError("this learner holds no reference policy (LearnerSpec.reference is false)")
        if model == "teacher" and self.teacher is None:
            raise RuntimeError("this learner holds no teacher (LearnerSpec.teacher is None)")
        self.engine.eval()
        out = []
        for mb in micro_batches:
            mb = self._to_device(mb)
            where = positions(mb) if positions is not None else None
            frozen = {"reference": self.reference, "teacher": self.teacher}.get(model)
            logp = (frozen.logprobs(mb, temperature, where) if frozen is not None
                    else token_logprobs(self.engine, mb, temperature, positions=where)[0])
            out.append(logp.cpu())
        return out

    def sequence_logprobs(self, sequences: list[list[int]], pixels: dict[str, Any] | None = None) -> list[list[float]]:
        """Logprob of each token `t >= 1` of each sequence given its prefix (and `pixels`, the
        image inputs of its rows with images), under the current policy at temperature 1: the
        learner's side of `RolloutWorker.sequence_logprobs`. Every rank must call (ZeRO-3)."""
        logp = self.logprobs([MicroBatch.padded(sequences, pixels)])[0]
        return [row[:len(s) - 1].tolist() for row, s in zip(logp, sequences)]

    def _frozen(self, objective: Objective) -> dict[str, Any]:
        """The frozen models the objective reads in its call (`objective.uses`: "teacher"), by name."""
        return {name: getattr(self, name).copy for name in getattr(objective, "uses", ())}

    def _to_device(self, batch: MicroBatch) -> MicroBatch:
        return MicroBatch.of(batch).to(self.engine.device)

    def _grad_norm_before_step(self) -> float | None:
        """Clip and return the global grad norm where rlkit clips (see `learner_clips`); else None
        (DeepSpeed's optimizer clips and `get_global_grad_norm` reports)."""
        if not self.clips:
            return None
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        max_norm = self.spec.optim.max_grad_norm if self.spec.optim.max_grad_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    # ------------------------------------------------------------------ weights

    def _named_weights(self, all_ranks: bool = False):
        from rlkit.learner.weights import iter_named_weights

        return iter_named_weights(self.engine.module, self.spec.deepspeed.zero_stage,
                                  lora_merge=self.spec.finetuning != "full", all_ranks=all_ranks)

    def push_weights(self, request: SyncRequest) -> dict | None:
        """Send the current policy to the rollout engines as `request` asks (`rlkit.transports`):
        its row's payload, every weight (LoRA merged) or the adapter's files. A colocated row loads
        each rank's own engine (every rank gathers); otherwise rank 0 sends to the request's
        engines while the other ranks take part in the ZeRO-3 gathers and return None. Rank 0
        returns the `SyncStats` as a dict. An engine call over the request's limit, or an engine
        that died, is an `ActorFault` naming the engine, raised after rank 0 has gone through the
        remaining gathers, so the other ranks are not left waiting in one and the push can be
        retried. With `defer` (a deferrable row) the engines' loads may be left running: the
        stats then carry `pending` (`PendingLoads`), for the driver to wait on."""
        from rlkit.sync.weight_sync import SyncTarget, open_transport

        kind = request.transport
        if kind.colocated:
            return self.colocated.load_weights(kind, self._named_weights(all_ranks=True))
        payload = self._adapter_files() if kind.payload.adapter else self._named_weights()
        if self.rank != 0:
            for _ in payload or ():  # take part in the gathers (the adapter's: already taken)
                pass
            return None
        try:
            sync = self._transports.get(kind.name) or open_transport(kind, SyncTarget(
                request.engines, request.bucket_mib, request.timeout_s, request.names, self.engine.device,
                self.device_info.weight_sync_backend))
            if kind.persistent:
                self._transports[kind.name] = sync
            return sync.push(payload, request.defer if kind.deferrable else False).as_dict()
        except Exception:
            for _ in payload:  # the gathers the other ranks are in (none after a failed gather)
                pass
            raise

    def _adapter_files(self) -> dict[str, bytes] | None:
        """The LoRA adapter alone, as the files of a peft adapter directory (what
        `RolloutWorker.load_adapter` takes); rank 0 returns them, the other ranks take part in the
        ZeRO-3 gather and return None."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlkit-adapter-") as tmp:
            if not self._save_adapter(Path(tmp)):
                return None
            return {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.is_file()}

    @torch.no_grad()
    def mix_reference(self, alpha: float) -> None:
        """TR-DPO's reference update on every rank: reference <- alpha * policy + (1 - alpha) *
        reference, parameter by parameter (a ZeRO-3 policy gathered one module at a time)."""
        if self.reference is None or self.reference.copy is None:
            raise RuntimeError("this learner holds no frozen reference copy to move (full fine-tuning only)")
        own = dict(self.reference.copy.named_parameters())
        for name, tensor in self._named_weights(all_ranks=True):
            own[name].mul_(1.0 - alpha).add_(tensor.to(own[name].dtype), alpha=alpha)
        self.reference.moved = True

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor) of the current policy with LoRA merged; only rank 0 returns tensors."""
        return [(name, t.detach().cpu()) for name, t in self._named_weights()]
