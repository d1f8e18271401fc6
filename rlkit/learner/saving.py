"""What a learner writes and reads back (`Learner` takes these methods): checkpoints (DeepSpeed's
engine state, with the optimizer and the lr schedule, each rank's RNG states, and a reference
copy that has moved from the starting model: TR-DPO's), the final
model, and a LoRA adapter's files (a push of the adapter sends them too)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from rlkit import faults

REFERENCE_FILE = "reference.pt"  # a moved reference copy's weights (rank 0's; every rank holds the same)


class Saving:
    """Checkpoints and the final model of one learner rank."""

    engine: Any  # the DeepSpeed engine
    spec: Any  # the `LearnerSpec`
    rank: int
    world_size: int
    reference: Any  # the `Reference` (or None)
    _named_weights: Any  # the learner's (HF name, tensor) of the policy, LoRA merged (ZeRO-3: every rank gathers)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """All ranks: engine (weights/adapter, optimizer, scheduler) + this rank's RNG states."""
        faults.crash_here("save_checkpoint", f"learner{self.rank}")
        faults.full_disk_here(f"learner{self.rank}")
        self.engine.save_checkpoint(ckpt_dir, tag="engine", save_latest=False,
                                    exclude_frozen_parameters=self.spec.finetuning != "full")
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        torch.save(rng, Path(ckpt_dir) / f"rng_rank{self.rank}.pt")
        if self.rank == 0 and self.reference is not None and self.reference.moved:  # the same on every rank
            torch.save(self.reference.copy.state_dict(), Path(ckpt_dir) / REFERENCE_FILE)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """This rank's part of checkpoint `ckpt_dir`; a checkpoint whose optimizer state this learner
        cannot read (another rank count for a partitioned state, another layout: an rlkit before the
        bf16 optimizer change, another ZeRO stage, precision or offload) is one line saying how to
        start from its weights alone."""
        from rlkit.errors import UserError

        weights_only = (f"start from its weights alone: rlkit export {ckpt_dir} --out DIR, then model.path=DIR "
                        "checkpoint.resume=never")
        written = len(list((Path(ckpt_dir) / "engine").glob("*_optim_states.pt")))
        world = self.world_size
        if written and written != world:
            raise UserError(f"{ckpt_dir} holds the optimizer state of {written} learners (DeepSpeed partitions it "
                            f"at ZeRO 1-3, and for bf16 at ZeRO 0), this run has {world}: resume with {written}, or "
                            f"{weights_only}", "checkpoint.resume")
        try:
            path, _ = self.engine.load_checkpoint(ckpt_dir, tag="engine",
                                                  load_module_strict=self.spec.finetuning == "full")
        except FileNotFoundError as e:
            missing = Path(e.filename).name if e.filename else str(e)
            raise UserError(f"{ckpt_dir} has no {missing}: its optimizer state is in another "
                            "layout (written by an rlkit before the bf16 optimizer change, or with another ZeRO "
                            f"stage, precision or offload); {weights_only}", "checkpoint.resume") from None
        if path is None:
            raise RuntimeError(f"{ckpt_dir}: DeepSpeed found no engine checkpoint to load")
        moved = Path(ckpt_dir) / REFERENCE_FILE
        if moved.exists() and self.reference is not None and self.reference.copy is not None:
            self.reference.copy.load_state_dict(torch.load(moved, weights_only=True))
            self.reference.moved = True
        rng = torch.load(Path(ckpt_dir) / f"rng_rank{self.rank}.pt", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])

    def save_model(self, out_dir: str, tokenizer_dir: str) -> str | None:
        """Final output on rank 0: a HF model dir (full), or `adapter/` + the merged model (LoRA)."""
        from transformers import AutoTokenizer

        from rlkit.model.load import merge_adapter
        from rlkit.model.vision import save_processor

        out, module = Path(out_dir), self.engine.module
        if self.spec.finetuning == "full":
            state = dict(self._named_weights())
            if self.rank == 0:
                module.save_pretrained(out, state_dict=state, safe_serialization=True)
        else:
            self._save_adapter(out / "adapter")
            if self.rank == 0:  # QLoRA: merged onto the full-precision base, as peft does
                merge_adapter(out / "adapter", self.spec.model.path, out, head=self.spec.head)
        if self.rank != 0:
            return None
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        save_processor(tokenizer_dir, out)
        return str(out)

    def _save_adapter(self, out: Path) -> bool:
        """peft's adapter directory at `out` from rank 0 (True there); every rank must call, for the
        ZeRO-3 gather of the trainable parameters."""
        import deepspeed

        module = self.engine.module
        trainable = [p for p in module.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None,
                                               enabled=self.spec.deepspeed.zero_stage == 3):
            if self.rank == 0:
                module.save_pretrained(out, safe_serialization=True)
        return self.rank == 0
