"""The policy learner: one DeepSpeed engine per rank, run inside a Ray actor (see `group.py`).

SFT and GRPO share it. Ranks form a torch.distributed group (gloo on CPU, nccl/hccl on
accelerators, from the device layer). Batches arrive as dicts of CPU tensors per micro-batch.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkit.config import DeepSpeedConfig, LoraConfig, ModelConfig, OptimConfig, QuantConfig


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


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL over labels != -100 and the token count. logits [B,T,V], labels [B,T]."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    n = (shift_labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, n


class Learner:
    """One rank. Create, then `init_process_group` on every rank at once, then `build`."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int):
        from rlkit.accel import apply_env, configure_cpu_threads, detect

        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.device_info = detect(spec.device)
        apply_env(self.device_info)
        if not self.device_info.is_accelerator:
            configure_cpu_threads()
        self.engine: Any = None
        self.clips = False
        self._ds_hf_config: Any = None  # keeps HfDeepSpeedConfig alive for ZeRO-3 loading
        self._broadcast: Any = None  # BroadcastSync, set up on first push (rank 0)
        self.rollout: Any = None  # colocated vLLM engine (RolloutWorker), see start_rollout
        self._rollout_asleep = False

    # ------------------------------------------------------------------ setup

    def address(self) -> tuple[str, int]:
        """(ip, free port) of this actor, for rank 0 to host the process group."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        import deepspeed

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        deepspeed.init_distributed(dist_backend=self.device_info.dist_backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=self.spec.deepspeed.dist_timeout_s))

    def build(self) -> dict[str, Any]:
        """Load the model, wrap it (LoRA/QLoRA), create the DeepSpeed engine. Returns a summary."""
        import deepspeed

        from rlkit import models
        from rlkit.engine.ds_config import deepspeed_config, learner_clips, lr_lambda

        spec = self.spec
        self.seed_everything(spec.seed)
        dtype = models.resolve_dtype(spec.model.dtype, self.device_info.bf16 and self.device_info.is_accelerator)
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        ds_cfg = deepspeed_config(spec.deepspeed, spec.optim, precision, spec.micro_batch_size,
                                  spec.grad_accum, self.world_size)
        if spec.deepspeed.zero_stage == 3 and spec.finetuning == "full":
            from transformers.integrations import HfDeepSpeedConfig

            self._ds_hf_config = HfDeepSpeedConfig(ds_cfg)  # every rank loads: partitioned on load
        load_dtype = torch.float32 if precision != "fp32" and spec.finetuning == "full" else dtype
        model = models.load_model(spec.model, load_dtype, spec.qlora if spec.finetuning == "qlora" else None)
        model = models.wrap_for_training(model, spec.finetuning, spec.lora)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None
        if spec.deepspeed.torch_adam:
            optimizer = torch.optim.AdamW(params, lr=spec.optim.lr, betas=spec.optim.betas, eps=spec.optim.eps,
                                          weight_decay=spec.optim.weight_decay)
        schedule = lr_lambda(spec.optim, spec.total_steps)
        # A callable: DeepSpeed builds it on the unwrapped optimizer, steps it at each accumulation
        # boundary and saves it in checkpoints.
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, config=ds_cfg,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.clips = learner_clips(spec.deepspeed, precision)
        if self.world_size == 1 and spec.deepspeed.zero_stage == 0:
            # One rank: nothing to reduce, but DeepSpeed would still flatten, all-reduce and copy
            # back every gradient at each step (~8% of a 25M-parameter step on CPU).
            self.engine.enable_backward_allreduce = False
        trainable, total = models.trainable_summary(model)
        return {"trainable_params": trainable, "total_params": total, "precision": precision,
                "device": self.device_info.kind, "zero_stage": spec.deepspeed.zero_stage}

    @staticmethod
    def seed_everything(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(seed % (2**32))
        except ImportError:
            pass

    # ------------------------------------------------------------------ SFT

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.engine.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        if "position_ids" in batch:
            kwargs["position_ids"] = batch["position_ids"]
        return self.engine(**kwargs, use_cache=False).logits

    def sft_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches (token-mean loss per micro-batch)."""
        assert len(micro_batches) == self.spec.grad_accum, "driver must send grad_accum micro-batches"
        self.engine.train()
        loss_sum, tokens, norm = 0.0, 0, None
        for i, mb in enumerate(micro_batches):
            mb = self._to_device(mb)
            nll, n = token_nll(self._forward(mb), mb["labels"])
            loss = nll / n.clamp(min=1)
            self.engine.backward(loss)
            if i == len(micro_batches) - 1:
                norm = self._grad_norm_before_step()
            self.engine.step()
            loss_sum += float(nll.detach())
            tokens += int(n)
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        return {"loss_sum": loss_sum, "tokens": tokens, "grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": float(self.engine.lr_scheduler.get_last_lr()[0])}

    def _grad_norm_before_step(self) -> float | None:
        """Clip and return the global grad norm where rlkit clips (see `learner_clips`); else None
        (DeepSpeed's optimizer clips and `get_global_grad_norm` reports)."""
        if not self.clips:
            return None
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        max_norm = self.spec.optim.max_grad_norm if self.spec.optim.max_grad_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    @torch.no_grad()
    def eval_nll(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """(summed NLL, tokens) over this rank's eval shard."""
        self.engine.eval()
        total, count = 0.0, 0
        for mb in micro_batches:
            mb = self._to_device(mb)
            nll, n = token_nll(self._forward(mb), mb["labels"])
            total += float(nll)
            count += int(n)
        return total, count

    # ------------------------------------------------------------------ GRPO

    def build_reference(self) -> None:
        """Set up the frozen reference policy (only needed when beta > 0)."""
        from rlkit import models
        from rlkit.grpo.policy import Reference

        dtype = self.engine.module.dtype if self.spec.finetuning == "full" else None
        self.reference = Reference(self.engine.module, self.spec.finetuning,
                                   lambda: models.load_model(self.spec.model, dtype).to(self.engine.device))

    @torch.no_grad()
    def rollout_logprobs(self, micro_batches: list[dict[str, torch.Tensor]], temperature: float,
                         which: str = "policy") -> list[torch.Tensor]:
        """logp [B, L-1] per micro-batch under the current policy ("policy") or the reference ("ref")."""
        from rlkit.grpo.policy import completion_logprobs

        self.engine.eval()
        out = []
        for mb in micro_batches:
            mb = self._to_device(mb)
            if which == "ref":
                out.append(self.reference.logprobs(mb, temperature).cpu())
            else:
                out.append(completion_logprobs(self.engine, mb, temperature)[0].cpu())
        return out

    def grpo_step(self, micro_batches: list[dict[str, torch.Tensor]], temperature: float,
                  loss_args: dict[str, Any]) -> dict[str, float]:
        """One optimizer step of the clipped policy loss over `grad_accum` micro-batches."""
        from rlkit.grpo.loss import policy_loss
        from rlkit.grpo.policy import completion_logprobs

        self.engine.train()
        sums: dict[str, float] = {}
        norm = None
        for i, mb in enumerate(micro_batches):
            mb = self._to_device(mb)
            logp, entropy = completion_logprobs(self.engine, mb, temperature, with_entropy=True)
            out = policy_loss(logp, mb.get("old_logp"), mb["advantages"], mb["completion_mask"][:, 1:].float(),
                              ref_logp=mb.get("ref_logp"), entropies=entropy, **loss_args)
            self.engine.backward(out.loss)
            if i == len(micro_batches) - 1:
                norm = self._grad_norm_before_step()
            self.engine.step()
            for k in ("loss", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "kl_mean", "entropy"):
                v = getattr(out, k)
                if v is not None:
                    sums[k] = sums.get(k, 0.0) + float(v) / len(micro_batches)
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        return {**sums, "grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": float(self.engine.lr_scheduler.get_last_lr()[0])}

    def push_weights(self, engines: list[Any], bucket_mb: float, strategy: str = "object_store") -> dict[str, float] | None:
        """Send the current policy (LoRA merged) to separate rollout engines; every rank must call
        (ZeRO-3 gathers layer by layer), rank 0 sends: through the Ray object store, or by
        NCCL/HCCL broadcast (`strategy="broadcast"`, accelerators; the group is set up on first use)."""
        from dataclasses import asdict

        from rlkit.engine.weight_sync import BroadcastSync, ObjectStoreSync, iter_named_weights

        named = iter_named_weights(self.engine.module, self.spec.deepspeed.zero_stage,
                                   lora_merge=self.spec.finetuning != "full")
        if self.rank != 0:
            for _ in named:  # take part in the gathers
                pass
            return None
        if strategy == "broadcast":
            if self._broadcast is None:
                import ray

                addr, port = self.address()
                tp_sizes = ray.get([e.tensor_parallel_size.remote() for e in engines])
                self._broadcast = BroadcastSync(engines, tp_sizes, addr, port, self.engine.device,
                                                self.device_info.weight_sync_backend, bucket_mb)
                self._broadcast.setup()
            return asdict(self._broadcast.push(named))
        return asdict(ObjectStoreSync(engines, bucket_mb).push(named))

    # ------------------------------------------------------------------ colocated rollout engine

    def start_rollout(self, model_path: str, worker_kwargs: dict[str, Any]) -> float:
        """Colocated mode (verl's hybrid engine, TRL's colocate): a vLLM engine inside this rank's
        process. With several ranks vLLM joins the existing torch.distributed world
        (`external_launcher`); each rank's engine is an independent replica (TP 1). Returns the
        engine's start seconds."""
        from rlkit.engine.rollout import RolloutWorker, cpu_engine_env

        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not self.device_info.is_accelerator:
            env = cpu_engine_env(worker_kwargs.get("kv_cache_gib") or 1.0, torch.get_num_threads())
        for key, value in env.items():
            os.environ.setdefault(key, value)
        kwargs = dict(worker_kwargs)
        engine_kwargs = dict(kwargs.pop("engine_kwargs", None) or {})
        if self.world_size > 1:
            engine_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        self.rollout = RolloutWorker(model_path, engine_kwargs=engine_kwargs, **kwargs)
        return self.rollout.ready()

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        """`RolloutWorker.generate` on this rank's colocated engine."""
        self._wake_rollout()
        return self.rollout.generate(*args, **kwargs)

    def rollout_sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """`RolloutWorker.sequence_logprobs` on the colocated engine (weight checks)."""
        self._wake_rollout()
        return self.rollout.sequence_logprobs(sequences)

    def sleep_rollout(self) -> None:
        """Free the colocated engine's device memory (KV cache, weights to host) while training;
        vLLM sleep mode, accelerators only (`rollout.sleep`)."""
        if self.rollout is not None and self.rollout.sleep_enabled and not self._rollout_asleep:
            self.rollout.llm.sleep(level=1)
            self._rollout_asleep = True

    def _wake_rollout(self, tags: list[str] | None = None) -> None:
        if self._rollout_asleep:
            self.rollout.llm.wake_up(tags=tags)
            self._rollout_asleep = tags is not None and "kv_cache" not in tags

    def push_weights_local(self) -> dict[str, float]:
        """Colocated mode: every rank loads the current policy into its own engine in place;
        tensors are handed over in-process, never copied or serialised (ZeRO-3: gathered module
        by module on all ranks)."""
        from dataclasses import asdict

        from rlkit.engine.weight_sync import InProcessSync, iter_named_weights

        self._wake_rollout(["weights"])
        named = iter_named_weights(self.engine.module, self.spec.deepspeed.zero_stage,
                                   lora_merge=self.spec.finetuning != "full", all_ranks=True)
        stats = InProcessSync(self.rollout).push(named)
        return asdict(stats)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """All ranks: engine (weights/adapter, optimizer, scheduler) + this rank's RNG states."""
        self.engine.save_checkpoint(ckpt_dir, tag="engine", save_latest=False,
                                    exclude_frozen_parameters=self.spec.finetuning != "full")
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        torch.save(rng, Path(ckpt_dir) / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, ckpt_dir: str) -> None:
        path, _ = self.engine.load_checkpoint(ckpt_dir, tag="engine", load_module_strict=self.spec.finetuning == "full")
        if path is None:
            raise RuntimeError(f"{ckpt_dir}: DeepSpeed found no engine checkpoint to load")
        rng = torch.load(Path(ckpt_dir) / f"rng_rank{self.rank}.pt", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])

    def save_model(self, out_dir: str, tokenizer_dir: str) -> str | None:
        """Final output on rank 0: a HF model dir (full), or `adapter/` + the merged model (LoRA)."""
        import deepspeed
        from transformers import AutoTokenizer

        from rlkit import models
        from rlkit.engine.weight_sync import iter_named_weights

        out, module = Path(out_dir), self.engine.module
        if self.spec.finetuning == "full":
            state = dict(iter_named_weights(module, self.spec.deepspeed.zero_stage, lora_merge=False))
            if self.rank == 0:
                module.save_pretrained(out, state_dict=state, safe_serialization=True)
        else:
            trainable = [p for p in module.parameters() if p.requires_grad]
            gather = self.spec.deepspeed.zero_stage == 3
            with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None, enabled=gather):
                if self.rank == 0:
                    module.save_pretrained(out / "adapter", safe_serialization=True)
            if self.rank == 0:  # QLoRA: merged onto the full-precision base, as peft does
                models.merge_adapter(out / "adapter", self.spec.model.path, out)
        if self.rank != 0:
            return None
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        return str(out)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor) of the current policy with LoRA merged; only rank 0 returns tensors."""
        from rlkit.engine.weight_sync import iter_named_weights

        return [(name, t.detach().cpu()) for name, t in
                iter_named_weights(self.engine.module, self.spec.deepspeed.zero_stage, lora_merge=True)]
