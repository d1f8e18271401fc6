"""The `rollout` section of a GRPO recipe: the vLLM engines (how many, where, how they sample),
the weight sync to them and its check, tools and environments, and an agent program
(`rlkit.program_config`). The engine layer reads it; `rlkit.grpo.config` adds its cross-section rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlkit.program_config import ProgramConfig
from rlkit.recipe import check
from rlkit.transports import LoraSync, SyncName, colocation_problem, payload_problem


@dataclass(frozen=True)
class RolloutConfig:
    num_engines: int = 1  # vLLM engines (each tensor_parallel_size devices)
    tensor_parallel_size: int = 1  # devices per engine
    temperature: float = 1.0  # sampling temperature of the rollouts
    top_p: float = 1.0  # nucleus sampling
    max_tokens: int = 64  # completion length limit (tokens); longer ones are cut (truncated)
    stop: tuple[str, ...] = ()  # stop strings
    max_model_len: int = 1024  # prompt + completion tokens an engine accepts
    gpu_memory_utilization: float = 0.5  # share of device memory a vLLM engine may take
    kv_cache_gib: float = 1.0  # CPU engines: KV cache cap in GiB (vLLM takes 16 GiB otherwise)
    sync_bucket_mib: int = 256  # weight sync through the Ray object store, one bucket (MiB) at a time
    # Placement: False = engines in their own actors and devices; True = one engine inside each
    # learner process (hybrid engine), sharing its device, weights handed over in-process.
    colocate: bool = False
    # The weight-sync transport (rlkit/transports.py): auto = in_process when colocated, else
    # object_store; broadcast = NCCL/HCCL group from learner rank 0 to every engine worker
    # (accelerators; opt-in, not yet checked on a GPU here).
    sync: SyncName = "auto"
    sleep: bool = True  # colocated on an accelerator: vLLM sleep mode frees engine memory while training
    # LoRA/QLoRA policies: merged = send base + adapter merged (every weight, every sync); adapter =
    # engines serve the base with vLLM's LoRA and each sync sends only the adapter (separate
    # engines; for QLoRA the engines' base is the full-precision model.path, no lossy merge).
    lora_sync: LoraSync = "merged"
    # Every weight sync and engine call (generate, sync check) waits at most this long, then the run
    # stops with a one-line error naming the engine and the phase; 0 = wait forever.
    sync_timeout_s: float = 1800.0
    start_timeout_s: float = 1800.0  # the same for an engine's start (model load, KV cache, graphs)
    # A separate engine that dies (crash, OOM, kill) or does not answer within sync_timeout_s is
    # restarted in its placement bundle, given the current weights, and its lost requests are sent
    # again; after max_restarts restarts of one engine the run stops instead. 0 = stop at once.
    max_restarts: int = 3
    # Parity probe: after the start (or resume) and every N-th weight sync, the engines and the
    # learner score the first train and held-out prompts (with their images); the largest
    # |logprob difference| is the metric sync/check_abs_diff_max (the mean:
    # sync/check_abs_diff_mean); above sync_check_tol (nats) the run stops naming the engine. The
    # tolerance bounds the largest gap for fp32 models (default 1e-3), the mean gap for bf16/fp16
    # ones (default 0.2: half-precision kernels put single tokens ~0.6 nats apart on a correct
    # sync), the largest for QLoRA with lora_sync: adapter (2.0). 0 = off.
    sync_check_every: int = 0
    sync_check_tol: float | None = None  # see sync_check_every
    # Multi-turn rollouts (rlkit/agent, TRL's contract; chat template only): functions the model may
    # call ("module:function" or "file.py:function" beside the recipe; type hints and a docstring)
    tools: tuple[str, ...] = ()
    # an environment factory ("module:Factory", or {name: factory} with an `environment` column per
    # row): each rollout gets an instance, reset(**row), whose public methods are its tools
    environment: str | dict[str, str] | None = None
    # a gym-style interaction factory (rlkit's; games, dialogue, user simulators): reset(**row), then
    # step(assistant_message) -> (observation or None, reward or None, done) after each model turn
    interaction: str | dict[str, str] | None = None
    max_tool_calls: int | None = None  # rounds of tool calls per rollout (TRL max_tool_calling_iterations)
    # the inline calculator (rlkit/agent/calculator.py, GSM8K's): after the model writes an arithmetic
    # expression and "=", its value is appended as tokens out of the loss, and generation goes on
    calculator: bool = False
    tool_timeout_s: float | None = 30.0  # a tool call running longer fails: its result is an error
    # the user's own agent program, talking to the engines through an OpenAI-compatible endpoint
    program: ProgramConfig = field(default_factory=ProgramConfig)

    def __post_init__(self):
        mismatch = colocation_problem(self.sync, self.colocate)
        check(mismatch is None, "sync", str(mismatch))
        payload = payload_problem(self.sync, self.colocate, self.lora_sync)
        check(payload is None, *(payload or ("", "")))
        check(not self.colocate or self.tensor_parallel_size == 1, "tensor_parallel_size",
              "colocated engines are one replica per learner rank (tensor_parallel_size 1); "
              "set colocate: false for tensor-parallel engines")
        check(self.num_engines >= 1, "num_engines", f"must be >= 1, got {self.num_engines}")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        check(self.max_model_len >= 2, "max_model_len", f"must be >= 2 tokens, got {self.max_model_len}")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              f"must be in (0, 1] (a share of the device's memory), got {self.gpu_memory_utilization}")
        check(self.kv_cache_gib is None or self.kv_cache_gib > 0, "kv_cache_gib",
              f"must be > 0 GiB, got {self.kv_cache_gib}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(self.sync_timeout_s >= 0, "sync_timeout_s", f"must be >= 0 (0 = no limit), got {self.sync_timeout_s}")
        check(self.start_timeout_s >= 0, "start_timeout_s",
              f"must be >= 0 (0 = no limit), got {self.start_timeout_s}")
        check(self.max_restarts >= 0, "max_restarts", f"must be >= 0 (0 = never restart), got {self.max_restarts}")
        check(self.sync_check_every >= 0, "sync_check_every", f"must be >= 0 (0 = off), got {self.sync_check_every}")
        check(self.sync_check_tol is None or self.sync_check_tol > 0, "sync_check_tol",
              f"must be > 0 nats, got {self.sync_check_tol}")
        check(not (self.environment and self.interaction), "interaction",
              "a rollout has an environment (TRL's, with tools) or an interaction (gym-style), not both")
        check(not (self.calculator and (self.tools or self.environment or self.interaction)), "calculator",
              "the inline calculator runs its own rollout loop: not with tools, an environment or an interaction")
        check(not (self.program.on and (self.tools or self.environment or self.interaction or self.calculator)),
              "program", "an agent program runs its own turns: not with tools, an environment, an interaction or the "
              "calculator")
        check(self.max_tool_calls is None or self.max_tool_calls >= 0, "max_tool_calls",
              f"must be >= 0 (None: as many as max_tokens allows), got {self.max_tool_calls}")
        check(self.tool_timeout_s is None or self.tool_timeout_s > 0, "tool_timeout_s",
              f"must be > 0 seconds (None: no limit), got {self.tool_timeout_s}")
