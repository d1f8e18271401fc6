"""`rlkit kto`: KTO (TRL's `KTOTrainer`) on unpaired rows, the loop `rlkit dpo` runs
(`rlkit.dpo.run.run_pairs`) with rows in place of pairs: each learner scores its micro-batches
(the rows and their mismatched KL rows) under the reference, then steps TRL's KTO loss."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from rlkit.dpo.objective import cut
from rlkit.dpo.run import PairData, PairStage, RowKind, load_encoded, run_pairs
from rlkit.kto.config import KTOConfig
from rlkit.kto.objective import KTOObjective, kto_means, unpaired_batch


def _keep(enc: dict[str, Any], row: dict[str, Any], cutoff_len: int, mode: str) -> dict[str, Any]:
    prompt, completion = cut(enc["prompt_ids"], enc["completion_ids"], cutoff_len, mode)
    return {"prompt_ids": prompt, "completion_ids": completion, "label": enc["label"]}


def load_unpaired_data(data: Any, tokenizer: Any, seed: int = 0) -> PairData:
    """`load_encoded` of unpaired rows (pairs give two each)."""
    from rlkit.data.preference import with_response
    from rlkit.data.unpaired import encode_unpaired, load_unpaired

    kind = RowKind(load_unpaired, lambda row: with_response(row, row["completion"]), encode_unpaired,
                   lambda enc: [len(enc["prompt_ids"]) + len(enc["completion_ids"])], _keep, "rows", "a completion")
    return load_encoded(data, tokenizer, kind, seed)


def run_kto(cfg: KTOConfig, recipe_path: str | Path | None = None) -> Path:
    """Run KTO from a loaded recipe; returns the final model directory."""
    k = cfg.kto
    objective = KTOObjective(k.loss_type, k.beta, k.desirable_weight, k.undesirable_weight)
    collate = functools.partial(unpaired_batch, kl=k.loss_type == "kto", cutoff_len=cfg.data.cutoff_len)
    reference = "the policy with its adapters disabled" if cfg.finetuning != "full" else "a frozen copy"
    kl = "; KL estimate from each micro-batch's mismatched completions" if k.loss_type == "kto" else ""
    return run_pairs(cfg, PairStage("kto", objective, kto_means, True, "lm",
                                    f"loss {k.loss_type}, beta {k.beta}{kl}; reference: {reference}",
                                    load_unpaired_data, collate, "rows"))
