"""`rlkit kto`: KTO (TRL's `KTOTrainer`) on unpaired rows, the loop `rlkit dpo` runs
(`rlkit.dpo.run.run_pairs`) with rows in place of pairs: each learner scores its micro-batches
(the rows and their mismatched KL rows) under the reference, then steps TRL's KTO loss."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from rlkit.dpo.run import PairData, PairStage, cut, run_pairs
from rlkit.kto.config import KTOConfig
from rlkit.kto.objective import KTOObjective, kto_means, unpaired_batch


def load_unpaired_data(data: Any, tokenizer: Any, seed: int = 0) -> PairData:
    """Load, check and tokenise `data.train` (and `data.eval`) as unpaired rows (pairs give two
    each); a bad row is one line naming the file, the row and the column; a row whose prompt leaves
    no room for its completion under `data.cutoff_len` (keep_start) is one too."""
    from jinja2 import TemplateError

    from rlkit.data.templates import resolve_template
    from rlkit.data.unpaired import encode_unpaired, load_unpaired
    from rlkit.errors import DataError
    from rlkit.sft.run import report_truncation

    template, notes = data.template, []

    def encode(path: str, skip_bad_rows: bool, split: str | None) -> tuple[list[dict], list[str | None]]:
        nonlocal template
        loaded = load_unpaired(path, data.format, data.dataset, skip_bad_rows, split, seed=seed)
        if template == "auto":
            first = loaded.rows[0]
            row = {**first, **({"output": first["completion"]} if "messages" not in first else {})}
            template = resolve_template(template, row, tokenizer, loaded.source)
        rows, difficulties, lengths = [], [], []
        for n, row in enumerate(loaded.rows, 1):
            try:
                enc = encode_unpaired(row, tokenizer, template)
            except TemplateError as e:
                raise DataError(f"{loaded.source}: row {n}: the tokenizer's chat template refuses it ({e}); fix the "
                                "row, or set data.template: alpaca") from None
            if data.truncation_mode == "keep_start" and len(enc["prompt_ids"]) >= data.cutoff_len:
                raise DataError(f"{loaded.source}: row {n}: its prompt is {len(enc['prompt_ids'])} tokens, which "
                                f"leaves no room for a completion under data.cutoff_len {data.cutoff_len}: raise "
                                "cutoff_len, or set data.truncation_mode: keep_end")
            lengths.append(len(enc["prompt_ids"]) + len(enc["completion_ids"]))
            prompt, completion = cut(enc["prompt_ids"], enc["completion_ids"], data.cutoff_len, data.truncation_mode)
            rows.append({"prompt_ids": prompt, "completion_ids": completion, "label": enc["label"]})
            difficulties.append(row.get("difficulty"))
        note = report_truncation(f"{loaded.source} (rows)", lengths, data.cutoff_len)
        notes.extend([note] if note else [])
        return rows, difficulties

    train, difficulties = encode(data.train, data.skip_bad_rows, data.split)
    held_out = encode(data.eval, False, data.eval_split)[0] if data.eval else []
    return PairData(train, difficulties, held_out, tokenizer.pad_token_id, template, notes)


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
