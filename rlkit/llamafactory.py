"""A LLaMA-Factory training recipe read as it is (`llamafactory-cli train x.yaml`'s flat keys:
`model_name_or_path`, `stage`, `finetuning_type`, `dataset`, `pref_beta`, ...), turned into
rlkit's sections for `rlkit sft`, `dpo`, `rm` and `kto`.

Each key LLaMA-Factory reads becomes the rlkit key that does the same (`learning_rate` ->
`optim.lr`, `dataset` -> the entry of `dataset_dir`'s `dataset_info.json`, `pref_loss: sigmoid`
-> `dpo.loss_type: [sigmoid]`); a key that only tunes LLaMA-Factory's own machinery (its cache,
its workers, its plots) is left out and named in one line; a key whose meaning rlkit cannot keep
(several datasets, `val_size`, `pref_loss: kto_pair`) is one error naming the key and what to
write instead. A recipe is LLaMA-Factory's when its top level has `model_name_or_path` and no
rlkit section.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError

log = logging.getLogger("rlkit")

STAGES = {"sft": "sft", "dpo": "dpo", "rm": "rm", "kto": "kto"}
SECTIONS = ("model", "data", "train", "optim", "dpo", "kto", "lora", "deepspeed")

# flat key -> rlkit key (the value as it is)
SAME = {
    "model_name_or_path": "model.path", "trust_remote_code": "model.trust_remote_code",
    "cutoff_len": "data.cutoff_len", "output_dir": "output_dir", "logging_steps": "logging.every",
    "save_steps": "checkpoint.every", "eval_steps": "eval.every", "per_device_train_batch_size":
    "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum", "learning_rate": "optim.lr",
    "num_train_epochs": "train.epochs", "max_steps": "train.max_steps", "lr_scheduler_type": "optim.scheduler",
    "warmup_ratio": "optim.warmup_ratio", "warmup_steps": "optim.warmup_steps", "weight_decay":
    "optim.weight_decay", "max_grad_norm": "optim.max_grad_norm", "seed": "seed", "lora_rank": "lora.r",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "pref_beta": "{stage}.beta",
    "simpo_gamma": "dpo.simpo_gamma", "kto_chosen_weight": "kto.desirable_weight",
    "kto_rejected_weight": "kto.undesirable_weight", "deepspeed": "deepspeed.config",
    "gradient_checkpointing": "model.gradient_checkpointing", "packing": "data.packing",
}
# LLaMA-Factory's own machinery: nothing in rlkit to set
IGNORED = ("do_train", "overwrite_cache", "preprocessing_num_workers", "dataloader_num_workers", "plot_loss",
           "overwrite_output_dir", "save_only_model", "report_to", "ddp_timeout", "per_device_eval_batch_size",
           "eval_strategy", "evaluation_strategy", "save_strategy", "logging_dir", "run_name", "tokenized_path",
           "flash_attn", "enable_liger_kernel", "use_unsloth", "upcast_layernorm", "resize_vocab",
           "new_special_tokens", "streaming", "buffer_size", "mix_strategy", "interleave_probs",
           "disable_gradient_checkpointing", "dataloader_pin_memory", "remove_unused_columns", "do_eval")
# keys whose meaning rlkit cannot keep, refused wherever they appear: what to write instead
REFUSED = {
    "val_size": "rlkit holds out a file of its own: split the rows and set data.eval",
    "eval_dataset": "name the held-out rows' file as data.eval (one dataset_info.json entry: data.dataset)",
}


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """Whether a recipe's top level is LLaMA-Factory's: `model_name_or_path` and no rlkit section."""
    return "model_name_or_path" in raw and not any(isinstance(raw.get(s), dict) for s in SECTIONS)


def translate(raw: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """rlkit's nested recipe of a LLaMA-Factory recipe `raw` (read from `path`); the keys it leaves
    out are named in one warning. A key rlkit cannot keep is a `ConfigError` naming it."""
    stage = str(raw.get("stage", "sft"))
    if stage not in STAGES:
        _refuse(path, "stage", f"{stage!r}: rlkit trains the stages sft, dpo, rm and kto (LLaMA-Factory's ppo: "
                "rlkit grpo)")
    out: dict[str, Any] = {"stage": STAGES[stage]}
    left: list[str] = []
    for key, value in raw.items():
        if key in SAME:
            _put(out, SAME[key].format(stage=stage), value)
        elif key in REFUSED:
            _refuse(path, key, REFUSED[key])
        elif key in IGNORED:
            left.append(key)
        elif key not in _READ_BELOW:
            _refuse(path, key, "not a LLaMA-Factory key rlkit reads; write the recipe in rlkit's sections "
                    "(docs/recipes.md) to use rlkit's own keys")
    _method(raw, out, path)
    _data(raw, out, path)
    _precision(raw, out)
    LOSSES.get(stage, lambda *_: None)(raw, out, path)
    if left:
        log.warning("rlkit: %s is a LLaMA-Factory recipe, read as rlkit's keys; left out (LLaMA-Factory's own "
                    "machinery): %s", path, ", ".join(left))
    return out


_READ_BELOW = ("stage", "finetuning_type", "lora_target", "quantization_bit", "quantization_method", "dataset",
               "dataset_dir", "template", "max_samples", "bf16", "fp16", "pure_bf16", "pref_loss", "pref_ftx",
               "resume_from_checkpoint")


def _method(raw: dict[str, Any], out: dict[str, Any], path: str | Path) -> None:
    kind = str(raw.get("finetuning_type", "lora"))  # LLaMA-Factory's default
    if kind not in ("full", "lora"):
        _refuse(path, "finetuning_type", "rlkit trains full, lora or qlora: write finetuning_type: full or lora")
    bits = raw.get("quantization_bit")
    if bits is not None and (bits != 4 or kind != "lora"):
        _refuse(path, "quantization_bit", "rlkit's QLoRA is 4-bit: write quantization_bit: 4, or leave it out")
    method = str(raw.get("quantization_method", "bnb"))  # LLaMA-Factory's default: bitsandbytes
    if bits is not None and method != "bnb":
        _refuse(path, "quantization_method", f"{method!r}: rlkit's QLoRA quantises with bitsandbytes: write "
                "quantization_method: bnb (or leave it out)")
    out["finetuning"] = "qlora" if bits == 4 else kind
    if kind == "lora":
        target = str(raw.get("lora_target", "all"))
        modules = ["all-linear"] if target == "all" else [t.strip() for t in target.split(",") if t.strip()]
        lora = out.setdefault("lora", {})
        lora["target_modules"] = modules
        lora.setdefault("r", 8)  # LLaMA-Factory's defaults: rank 8, alpha twice the rank, dropout 0
        lora.setdefault("alpha", 2 * lora["r"])
        lora.setdefault("dropout", 0.0)
        if bits == 4:
            out["qlora"] = {}
    if raw.get("resume_from_checkpoint"):
        out.setdefault("checkpoint", {})["resume"] = str(raw["resume_from_checkpoint"])


def _data(raw: dict[str, Any], out: dict[str, Any], path: str | Path) -> None:
    names = [n.strip() for n in str(raw.get("dataset", "")).split(",") if n.strip()]
    if len(names) != 1:
        _refuse(path, "dataset", f"name one dataset_info.json entry (got {len(names)}): rlkit reads one "
                "dataset per recipe; merge the entries' files into one")
    folder = Path(str(raw.get("dataset_dir", "data")))
    data = out.setdefault("data", {})
    data.update(train=str(folder / "dataset_info.json"), dataset=names[0])
    template = str(raw.get("template", "alpaca"))
    data["template"] = "alpaca" if template == "alpaca" else "chat"  # a model's template: its tokenizer's own
    if raw.get("max_samples") is not None:
        _refuse(path, "max_samples", "rlkit reads every row: cut the file, or bound the run with max_steps")


def _precision(raw: dict[str, Any], out: dict[str, Any]) -> None:
    model = out.setdefault("model", {})
    model["dtype"] = "bf16" if raw.get("bf16") or raw.get("pure_bf16") else "fp16" if raw.get("fp16") else "fp32"
    if out.get("finetuning") == "qlora":
        out["qlora"]["compute_dtype"] = model["dtype"]


def _preference(raw: dict[str, Any], out: dict[str, Any], path: str | Path) -> None:
    """DPO's `pref_loss` and `pref_ftx` (the chosen side's NLL added with that weight) as TRL's names."""
    loss, ftx = str(raw.get("pref_loss", "sigmoid")), float(raw.get("pref_ftx", 0.0))
    if loss == "kto_pair":
        _refuse(path, "pref_loss", "kto_pair is not one of TRL's DPO losses: run rlkit kto on the same pairs")
    dpo = out.setdefault("dpo", {})
    if loss == "simpo":  # SimPO's NLL weight is CPO's alpha (0: SimPO proper, LLaMA-Factory's default)
        dpo.update(loss_type=[loss], cpo_alpha=ftx)
    elif loss == "orpo":
        if ftx:
            _refuse(path, "pref_ftx", "ORPO always trains the chosen side's NLL at weight 1 (TRL's ORPO): leave "
                    "pref_ftx out")
        dpo["loss_type"] = [loss]
    elif ftx:  # RPO: the loss plus TRL's sft loss at pref_ftx
        dpo.update(loss_type=[loss, "sft"], loss_weights=[1.0, ftx])
    else:
        dpo["loss_type"] = [loss]


def _put(out: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, last = dotted.split(".")
    node = out
    for s in sections:
        node = node.setdefault(s, {})
    node[last] = value


def _refuse(path: str | Path, key: str, why: str) -> None:
    raise ConfigError(f"{path}: {key}: {why}")


LOSSES = {"dpo": _preference}  # a stage whose loss LLaMA-Factory's pref_* keys choose: how they read
