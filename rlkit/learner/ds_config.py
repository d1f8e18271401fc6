"""DeepSpeed config and learning-rate schedule from the typed recipe (pure; no DeepSpeed import),
and a user's own DeepSpeed JSON (``deepspeed.config``) folded into the recipe at load."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.config import DeepSpeedConfig, OptimConfig
from rlkit.errors import ConfigError, read_json
from rlkit.recipe import merge


def deepspeed_config(ds: DeepSpeedConfig, optim: OptimConfig, dtype: str, micro_batch_size: int,
                     grad_accum: int, world_size: int) -> dict[str, Any]:
    """The JSON-able config passed to `deepspeed.initialize`; `ds.extra` is merged last.

    `dtype` is the training precision: "bf16", "fp16" or "fp32". The optimizer and scheduler are
    built by rlkit (torch AdamW + LambdaLR) unless `torch_adam` is false, in which case DeepSpeed
    builds its own (fused) AdamW from the "optimizer" section.
    """
    flat_bf16 = bf16_master_optimizer(ds, dtype)
    zero: dict[str, Any] = {"stage": 1 if flat_bf16 else ds.zero_stage}
    if ds.zero_stage >= 1 or flat_bf16:
        zero.update(contiguous_gradients=True, overlap_comm=False)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if ds.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": 0.0 if learner_clips(ds, dtype) else optim.max_grad_norm,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    }
    if flat_bf16:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if ds.torch_adam:
        # A torch optimizer under ZeRO-Offload: allowed, slower than DeepSpeedCPUAdam but no JIT build.
        cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}}
    return merge(cfg, ds.extra)


def bf16_master_optimizer(ds: DeepSpeedConfig, dtype: str) -> bool:
    """Whether `dtype` training runs DeepSpeed's BF16_Optimizer (`DeepSpeedConfig.flat_bf16`: bf16 at
    ZeRO 0 or 1, no offload): fp32 master weights and gradient accumulation in flat buffers, stepped
    by one fused AdamW over the flat partition, the bf16 weights copied back in one piece. DeepSpeed
    reaches it through stage 1 with an fp32 `grad_accum_dtype` (on one rank stage 1 partitions
    nothing); at stage 0 it would wrap the optimizer in FP16_UnfusedOptimizer, a copy, a norm and a
    step per tensor (77 ms of a 1.5B model's 317 ms step on an H200)."""
    return ds.flat_bf16(dtype)


def learner_clips(ds: DeepSpeedConfig, dtype: str) -> bool:
    """At ZeRO-0 in fp32 DeepSpeed clips without reporting the norm: rlkit clips there itself
    (one norm computation, which it also logs). Elsewhere DeepSpeed's optimizer clips and reports."""
    return ds.zero_stage == 0 and dtype == "fp32"


def zero3_alone(ds: DeepSpeedConfig, learners: int) -> str | None:
    """The line that says ZeRO-3 on one learner costs time and saves nothing (None otherwise): a
    single rank partitions nothing, yet gathers every layer before each use and again in backward."""
    if ds.zero_stage != 3 or learners > 1 or ds.offload_param or ds.offload_optimizer:
        return None
    return ("deepspeed.zero_stage: 3 with one learner partitions nothing but still gathers every layer at each "
            "use (on one H200 its step took 2.35x stage 0's, same memory): use zero_stage 0, or offload_param / "
            "offload_optimizer to move weights or optimizer states off the device")


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    return optim.warmup_steps or int(round(optim.warmup_ratio * total_steps))


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step `s` (0-based): linear warmup, then decay.

    cosine: min + (1-min) * 0.5 * (1 + cos(pi * progress)); linear: min + (1-min) * (1 - progress);
    constant: 1. `min` is `optim.min_lr_ratio`; progress runs 0..1 over the post-warmup steps.
    """
    warm = warmup_steps(optim, total_steps)
    floor = optim.min_lr_ratio

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if optim.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        if optim.scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1.0 - progress)

    return fn


# ------------------------------------------------------------------ a user's ds_config.json

_OFF = object()  # a file value that sets nothing (e.g. fp16.enabled: false)
_SCHEDULERS = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}


def fold_config_file(data: dict[str, Any], batch_keys: dict[str, str],
                     recipe_path: str | Path | None) -> tuple[dict[str, Any], dict[str, int]]:
    """Fold the DeepSpeed JSON named by ``deepspeed.config`` into the raw recipe `data`.

    A value the file sets fills the recipe key it means (ZeRO stage and offload, precision,
    clipping, AdamW params, warmup schedule, micro-batch size per `batch_keys`) where the
    recipe leaves that key unset; where the recipe sets it too, the two must agree (else one
    ConfigError naming both). ``"auto"`` takes the recipe's value. Everything else in the file
    (bucket sizes, overlap_comm, loss-scale settings, ...) goes to ``deepspeed.extra``, under
    the recipe's own ``extra``; an ``"auto"`` there is dropped (DeepSpeed's default applies).
    Returns the new data and the file's batch sizes the recipe only derives (train_batch_size,
    and gradient_accumulation_steps where no key holds it), to check once the recipe is built.
    """
    ds = data.get("deepspeed") if isinstance(data.get("deepspeed"), dict) else {}
    name = ds.get("config")
    if name is None:
        return data, {}
    if not isinstance(name, str):
        raise ConfigError(f"deepspeed.config: expected the path of a DeepSpeed JSON file, got {name!r}")
    file_cfg, where = _read_ds_json(name, recipe_path)
    found: dict[str, tuple[str, Any]] = {}  # recipe key -> (file key, value)

    def put(file_key: str, recipe_key: str, value: Any) -> None:
        if value is _OFF or value == "auto":
            return
        if recipe_key in found and not _same(found[recipe_key][1], value):  # e.g. optimizer lr vs warmup_max_lr
            raise ConfigError(f"{where}: {file_key} is {value!r} but {found[recipe_key][0]} is "
                              f"{found[recipe_key][1]!r}; both set {recipe_key}: make them agree")
        found.setdefault(recipe_key, (file_key, value))

    rest = dict(file_cfg)
    _fold_zero(rest, _get(data, "deepspeed.zero_stage") or 0, where, put, found)
    put("fp16.enabled / bf16.enabled", "model.dtype", _precision(rest, where))
    put("gradient_clipping", "optim.max_grad_norm", rest.pop("gradient_clipping", "auto"))
    _fold_optimizer(rest.pop("optimizer", None), where, put)
    _fold_scheduler(rest.pop("scheduler", None), where, put)
    claims = _fold_batch(rest, batch_keys, where, put)
    out = _fill(data, found, where)
    _set(out, "deepspeed.extra", merge(_drop_auto(rest), _get(data, "deepspeed.extra") or {}))
    return out, claims


def _fold_zero(rest: dict[str, Any], recipe_stage: int, where: str, put: Callable[[str, str, Any], None],
               found: dict[str, tuple[str, Any]]) -> None:
    """The file's ZeRO stage and offloads; the rest of `zero_optimization` stays in `rest`."""
    zero = dict(rest.pop("zero_optimization", None) or {})
    put("zero_optimization.stage", "deepspeed.zero_stage", zero.pop("stage", "auto"))
    stage = found.get("deepspeed.zero_stage", ("", recipe_stage))[1]
    for part in ("offload_optimizer", "offload_param"):
        sub = zero.get(part)
        if isinstance(sub, dict) and sub.get("device", "none") != "none":
            if part == "offload_param" and stage != 3:
                raise ConfigError(f"{where}: zero_optimization.offload_param needs stage 3, the config is at "
                                  f"stage {stage}: remove it, or use stage 3")
            put(f"zero_optimization.{part}", f"deepspeed.{part}", True)
        elif isinstance(sub, dict):
            zero.pop(part)
    if zero:
        rest["zero_optimization"] = zero


def _fold_batch(rest: dict[str, Any], batch_keys: dict[str, str], where: str,
                put: Callable[[str, str, Any], None]) -> dict[str, int]:
    """The file's batch sizes: into the keys the stage has for them, else claims checked later."""
    put("train_micro_batch_size_per_gpu", batch_keys["train_micro_batch_size_per_gpu"],
        rest.pop("train_micro_batch_size_per_gpu", "auto"))
    claims = {}
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        value = rest.pop(key, "auto")
        if value != "auto" and key in batch_keys:
            put(key, batch_keys[key], value)
        elif value != "auto":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {key} must be a positive integer or \"auto\", got {value!r}")
            claims[key] = value
    return claims


def _fill(data: dict[str, Any], found: dict[str, tuple[str, Any]], where: str) -> dict[str, Any]:
    """`data` with what the file sets filled in where the recipe leaves it unset (equal where both do)."""
    out = merge(data, {})
    for recipe_key, (file_key, value) in found.items():
        have = _get(data, recipe_key)
        if have is None:
            _set(out, recipe_key, value)
        elif not _same(have, value):
            raise ConfigError(f"{where}: {file_key} is {value!r} but the recipe sets {recipe_key}: {have!r}; "
                              "remove one (the file fills what the recipe leaves unset, \"auto\" takes the recipe's)")
    return out


def check_batch_claims(claims: dict[str, int], config_file: str, micro: int, accum: int, world: int,
                       keys: str) -> None:
    """The file's train_batch_size / gradient_accumulation_steps must be what the recipe gives."""
    given = {"train_batch_size": micro * accum * world, "gradient_accumulation_steps": accum}
    for key, value in claims.items():
        if value != given[key]:
            raise ConfigError(f"{config_file}: {key} is {value} but the recipe gives {given[key]} ({keys}: "
                              f"micro-batch {micro} x accumulation {accum} x learners {world}); "
                              f"set it to \"auto\" or {given[key]}")


def _read_ds_json(name: str, recipe_path: str | Path | None) -> tuple[dict[str, Any], str]:
    path = Path(name)
    if not path.is_absolute() and recipe_path is not None:
        beside = Path(recipe_path).resolve().parent / path
        path = beside if beside.exists() or not path.exists() else path
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: cannot read {name} (no such file)")
    cfg = read_json(path, dict, "a JSON object (a DeepSpeed config)", ConfigError)
    return cfg, str(path)


def _precision(rest: dict[str, Any], where: str) -> Any:
    on = {}
    for name in ("bf16", "fp16"):
        block = rest.get(name)
        if isinstance(block, dict):
            block = dict(block)
            on[name] = block.pop("enabled", "auto")
            if block:
                rest[name] = block  # loss-scale settings and the like go to extra
            else:
                rest.pop(name)
    if on.get("bf16") is True and on.get("fp16") is True:
        raise ConfigError(f"{where}: bf16.enabled and fp16.enabled are both true: enable one")
    return next((n for n in ("bf16", "fp16") if on.get(n) is True), _OFF)


def _fold_optimizer(opt: Any, where: str, put: Callable[[str, str, Any], None]) -> None:
    if opt is None:
        return
    kind = str(opt.get("type", "")) if isinstance(opt, dict) else ""
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"{where}: optimizer.type {kind or opt!r}: rlkit trains with AdamW; remove the "
                          "optimizer section or make it AdamW (its params fill optim.*)")
    params = opt.get("params") or {}
    for key, recipe_key in (("lr", "optim.lr"), ("betas", "optim.betas"), ("eps", "optim.eps"),
                            ("weight_decay", "optim.weight_decay")):
        put(f"optimizer.params.{key}", recipe_key, params.get(key, "auto"))


def _fold_scheduler(sched: Any, where: str, put: Callable[[str, str, Any], None]) -> None:
    if sched is None:
        return
    kind = str(sched.get("type", "")) if isinstance(sched, dict) else ""
    if kind.lower() not in _SCHEDULERS:
        raise ConfigError(f"{where}: scheduler.type {kind or sched!r} is not one rlkit maps (WarmupLR, "
                          "WarmupDecayLR, WarmupCosineLR); remove it and set optim.scheduler")
    params = sched.get("params") or {}
    put("scheduler.type", "optim.scheduler", _SCHEDULERS[kind.lower()])
    put("scheduler.params.warmup_num_steps", "optim.warmup_steps", params.get("warmup_num_steps", "auto"))
    put("scheduler.params.warmup_max_lr", "optim.lr", params.get("warmup_max_lr", "auto"))
    top, low = params.get("warmup_max_lr"), params.get("warmup_min_lr")
    if kind.lower() == "warmupcosinelr":
        put("scheduler.params.cos_min_ratio", "optim.min_lr_ratio", params.get("cos_min_ratio", "auto"))
    elif kind.lower() == "warmupdecaylr" and isinstance(low, (int, float)) and isinstance(top, (int, float)) and top:
        put("scheduler.params.warmup_min_lr", "optim.min_lr_ratio", low / top)


def _drop_auto(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_auto(v) for k, v in node.items() if v != "auto"}
    return node


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node[part] = dict(node.get(part) or {})
        node = node[part]
    node[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


# what rlkit sets from the recipe: a value under deepspeed.extra would contradict the run's own
OWNED = {"train_micro_batch_size_per_gpu": "the stage's micro_batch_size",
         "gradient_accumulation_steps": "the stage's gradient accumulation",
         "train_batch_size": "micro-batch x accumulation x learners", "optimizer": "optim.* (torch_adam: false)",
         "scheduler": "optim.scheduler", "bf16": "model.dtype", "fp16": "model.dtype"}


def check_deepspeed_config(ds: DeepSpeedConfig, optim: OptimConfig) -> None:
    """Before launch: `deepspeed.extra` sets nothing the recipe sets elsewhere, and DeepSpeed's own
    validation of the ZeRO section (its pydantic model: unknown keys, values out of range) passes,
    so a typo under `zero_optimization` is one line naming the key instead of a learner's traceback."""
    from rlkit.errors import UserError

    for key, where in OWNED.items():
        if key in ds.extra:
            raise UserError(f"{key} is set by rlkit from {where}: set that instead", "deepspeed.extra")
    zero = deepspeed_config(ds, optim, "fp32", 1, 1, 1)["zero_optimization"]
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # DeepSpeed missing is `rlkit doctor`'s line
        return
    try:
        DeepSpeedZeroConfig(**zero)
    except ValueError as e:  # pydantic's ValidationError
        errors = getattr(e, "errors", lambda: [])()
        what = "; ".join(f"zero_optimization.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in errors[:3])
        raise UserError(f"DeepSpeed rejects {what or str(e).splitlines()[0]} (its keys: "
                        "https://www.deepspeed.ai/docs/config-json/)", "deepspeed.extra") from None


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from building its shared-memory CPU op when it starts torch.distributed: the
    op serves only `inference_all_reduce`, which training never calls, and it is a C++ build at
    the first start on a machine (about 90 s here, and a compiler it needs). DeepSpeed keeps its
    table of compatible ops in one dict for such edits."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
