"""Score a batch with several reward functions concurrently; weighted sum; loud failures."""

from __future__ import annotations

import logging
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from types import ModuleType
from typing import Any, Literal

from rlkit.errors import DataError, FaultError, UserError
from rlkit.reward.contract import (
    Failed,
    RewardError,
    RewardResult,
    RewardSpec,
    prompt_text,
)
from rlkit.reward.resolve import ResolvedReward, is_object, resolve, source_object
from rlkit.reward.values import BadValue, Batch, failure, fallback, sample_text, validate

_log = logging.getLogger("rlkit")

Parallel = Literal["thread", "process", "none"]


class _Timeout(Exception):
    pass


class RewardScorer:
    """Resolve the recipe's rewards once, then score batches.

    specs: the recipe's ``rewards`` list. base_dir: the recipe's folder (for ``file.py:function``).
    columns: the dataset's column names (checked against required parameters; None skips the check).
    default: total for a sample where every function returned None (None: such a sample is an error).
    parallel: ``"thread"`` runs each function's call in its own thread (I/O, async and GIL-releasing
    rewards), ``"process"`` in a spawned process pool (CPU-bound pure-Python rewards; the function is
    re-imported there by its path), ``"none"`` one after another in the caller's thread (no timeouts).
    collect_errors: record failures in ``RewardResult.failures`` instead of raising (for
    ``rlkit reward test``). extra: rewards resolved elsewhere (an environment's ``get_reward``).

    A call that outlives ``timeout_s`` is abandoned (a thread cannot be killed; a process
    pool is restarted) and fails like an exception would.
    """

    def __init__(self, specs: Sequence[RewardSpec], base_dir: str | None = None,
                 columns: set[str] | None = None, default: float | None = None,
                 parallel: Parallel = "thread", collect_errors: bool = False,
                 extra: Sequence[ResolvedReward] = ()) -> None:
        if parallel not in ("thread", "process", "none"):
            raise RewardError(f"parallel: expected 'thread', 'process' or 'none', got {parallel!r}")
        if not specs and not extra:
            raise RewardError("rewards: the list is empty; name at least one reward function")
        self.rewards: list[ResolvedReward] = [
            resolve(s, base_dir, columns, key=f"rewards[{i}]") for i, s in enumerate(specs)] + list(extra)
        seen: dict[str, str] = {}
        for r in self.rewards:
            if r.name in seen:
                raise RewardError(f"{r.key}.name: {r.name!r} is also the name of {seen[r.name]}; "
                                  "set a distinct `name:`")
            seen[r.name] = r.key
        self.base_dir, self.default, self.parallel = base_dir, default, parallel
        self.collect_errors = collect_errors
        self._pool: ProcessPoolExecutor | None = None
        self._ready = False
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def check_rows(self, source: str, rows: Sequence[dict]) -> None:
        """Before launch: a reward that checks its data (``fn.rlkit_check_row(row)``, e.g. a code
        reward's test cases) reads every row; the first it refuses is one line naming the row."""
        for r in self.rewards:
            check = getattr(r.fn, "rlkit_check_row", None)
            if not callable(check):
                continue
            for n, row in enumerate(rows, 1):
                try:
                    check(row)
                except (UserError, ValueError, TypeError) as e:
                    raise DataError(f"{source}: row {n}: {r.key} ({r.name}) cannot judge it: {e}") from None

    def actor_bundles(self) -> list[tuple[str, dict[str, float]]]:
        """(recipe key, resources) of each Ray actor a reward serves itself from: a class (or
        callable object) whose `ray_resources()` returns what its actor asks for, or a list of that
        for several actors (None: it runs in-process). The run checks them against the cluster
        before launch, with the learners' and engines'."""
        out = []
        for r in self.rewards:
            ask = getattr(r.fn, "ray_resources", None) if is_object(r.fn) else None
            asked = ask() if callable(ask) else None
            for bundle in ([asked] if isinstance(asked, dict) else asked or []):
                out.append((r.key, {k: float(v) for k, v in bundle.items() if v}))
        return out

    def modules(self) -> list[ModuleType]:
        """The modules the reward callables come from (each once, in recipe order)."""
        out: dict[str, ModuleType] = {}
        for r in self.rewards:
            name = source_object(r.fn).__module__
            module = sys.modules.get(name)
            if module is not None:
                out.setdefault(name, module)
        return list(out.values())

    def setup(self) -> None:
        """Run every class reward's ``setup()`` (concurrently, no timeout). Idempotent."""
        if self._ready:
            return
        errs: list[BaseException] = []

        def one(r: ResolvedReward) -> None:
            try:
                r.ensure_setup()
            except Exception as e:  # noqa: BLE001 — reported below with the reward's key
                errs.append(RewardError(f"{r.key}: {r.name}.setup() failed: {type(e).__name__}: {e}"))
        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in self.rewards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errs:
            raise errs[0]
        self._ready = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def score(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence | None = None,
              columns: dict[str, Sequence] | None = None, prompt_texts: Sequence[str] | None = None) -> RewardResult:
        """Score one batch: every function on all samples, concurrently.

        columns: dataset column -> one value per sample. prompt_texts: the prompts as the
        model saw them (default: the prompts' text). Raises RewardError naming the function
        and the sample when a call fails (unless its spec has ``on_error``).
        """
        texts = list(prompt_texts) if prompt_texts is not None else [prompt_text(p) for p in prompts]
        batch = _check_batch(prompts, completions, completion_ids, {**(columns or {}), "prompt_texts": texts})
        n = len(batch[1])
        self.setup()
        runs = [self._start(r, batch) for r in self.rewards]
        per_fn: dict[str, list[float | None]] = {}
        errors: dict[str, int] = {}
        seconds: dict[str, float] = {}
        failures: dict[str, list[tuple[int, str]]] = {}
        clipped: dict[str, int] = {}
        for r, wait in zip(self.rewards, runs):
            t0 = time.perf_counter()
            try:
                out, secs = wait(self._limit(r, n))
                vals = validate(r, out, n, batch, clipped)
                self._count_failed(r, out, vals, batch, errors)
            except FaultError:  # a served model's actor died or passed its deadline: the run's fault, not a sample's
                raise
            except BadValue as e:  # wrong shape/type/range: a bug in the function, never defaulted
                if not self.collect_errors:
                    raise
                vals, secs = [None] * n, time.perf_counter() - t0
                failures[r.name] = [(-1, str(e))]
            except Exception as e:  # noqa: BLE001 — the user's reward raised or timed out
                vals, bad, gave_up = self._isolate(r, batch, e, clipped)
                secs = time.perf_counter() - t0
                errors[r.name] = len(bad) + gave_up
                if bad and self.collect_errors:
                    failures[r.name] = bad
                elif bad and r.name not in self._warned:
                    self._warned.add(r.name)
                    _log.warning("%s (that sample scores %s; counted in reward/%s/errors; this is said once; "
                                 "`fail_fast: true` stops the run instead)", bad[0][1], vals[bad[0][0]], r.name)
            per_fn[r.name], seconds[r.name] = vals, secs
        total = self._total(per_fn, batch, failures)
        return RewardResult(total=total, per_fn=per_fn, errors=errors, seconds=seconds, failures=failures,
                            clipped=clipped)

    def _limit(self, r: ResolvedReward, n: int) -> float | None:
        """How long a call on `n` samples may take: the spec's `timeout_s`, or longer where the
        function declares what such a batch takes (`contract.batch_seconds`)."""
        limit = r.spec.timeout_s
        if limit is not None and r.batch_seconds is not None:
            limit = max(limit, r.batch_seconds(n))
        return limit

    def _count_failed(self, r: ResolvedReward, out: Any, vals: list[float | None], batch: Batch,
                      errors: dict[str, int]) -> None:
        """The samples the function scored as `Failed`: counted in its errors, said once."""
        failed = [i for i, v in enumerate(out) if isinstance(v, Failed)]
        if not failed:
            return
        errors[r.name] = len(failed)
        if r.name not in self._warned:
            self._warned.add(r.name)
            i = failed[0]
            _log.warning("%s %r: sample %d %s %s, scored %s (counted in reward/%s/errors; this is said once)",
                         r.key, r.name, i, sample_text(batch, i), out[i].why or "failed", vals[i], r.name)

    # -- running calls -------------------------------------------------------------------

    def _start(self, r: ResolvedReward, batch: Batch) -> Callable[[float | None], tuple[Any, float]]:
        """Start one call; returns ``wait(timeout) -> (output, seconds)``."""
        if self.parallel == "process":
            return self._start_in_process(r, batch)
        box: dict[str, Any] = {}

        def target() -> None:
            t0 = time.perf_counter()
            try:
                box["out"] = r(*batch)
            except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
                box["exc"] = e
            box["secs"] = time.perf_counter() - t0
        th = None if self.parallel == "none" else threading.Thread(target=target, name=f"reward-{r.name}", daemon=True)
        (target if th is None else th.start)()

        def wait_thread(timeout: float | None) -> tuple[Any, float]:
            if th is not None:
                th.join(timeout)
                if th.is_alive():
                    raise _Timeout(f"timed out after {timeout:g} s")
            if "exc" in box:
                raise box["exc"]
            return box["out"], box["secs"]
        return wait_thread

    def _start_in_process(self, r: ResolvedReward, batch: Batch) -> Callable[[float | None], tuple[Any, float]]:
        """`parallel: process`: the call in the pool's spawned process; a timeout kills the pool."""
        fut = self._process_pool().submit(_process_call, r.spec, self.base_dir, r.key, batch)

        def wait_proc(timeout: float | None) -> tuple[Any, float]:
            try:
                return fut.result(timeout=timeout)
            except FutureTimeout:
                self._kill_pool()
                raise _Timeout(f"timed out after {timeout:g} s") from None
        return wait_proc

    def _process_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=len(self.rewards), mp_context=ctx)
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for p in list(getattr(pool, "_processes", {}).values()):
                p.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def _isolate(self, r: ResolvedReward, batch: Batch, exc: BaseException, clipped: dict[str, int]
                 ) -> tuple[list[float | None], list[tuple[int, str]], int]:
        """After a failed batch call: find the failing samples by calling one at a time; also how
        many of the others the function itself scored as `Failed` (counted in its errors too).

        A sample that fails alone costs that sample: it scores `_fallback` (counted), unless the
        spec says `fail_fast`. A timeout, a batch whose every sample fails (n > 1) and a batch that
        fails while each sample alone passes are the function's fault: they stop the run unless
        the spec has `on_error` (or errors are being collected).
        """
        prompts, completions, ids, cols = batch
        n = len(completions)
        # collecting (`rlkit reward test`): a failure shows as a failure, not as a score
        default = None if self.collect_errors and r.spec.on_error is None else fallback(r)
        explicit = r.spec.on_error is not None or self.collect_errors
        if isinstance(exc, _Timeout):
            msg = f"{r.key} {r.name!r} {exc} on a batch of {n} samples (raise `timeout_s:` or speed it up)"
            if not explicit:
                raise RewardError(f"{msg}; first sample {sample_text(batch, 0)}") from None
            return [default] * n, [(i, msg) for i in range(n)], 0
        vals: list[float | None] = []
        bad: list[tuple[int, str]] = []
        gave_up = 0
        for i in range(n):
            one = ([prompts[i]], [completions[i]], None if ids is None else [ids[i]],
                   {k: [v[i]] for k, v in cols.items()})
            try:
                out, _ = self._start(r, one)(self._limit(r, 1))
                vals.append(validate(r, out, 1, one, clipped)[0])
                gave_up += isinstance(out[0], Failed)
            except BadValue:  # a wrong value, not a raising call: never defaulted
                raise
            except Exception as e:  # noqa: BLE001
                msg = failure(r, e, batch, i)
                if r.spec.fail_fast and not self.collect_errors:
                    raise RewardError(msg) from None
                vals.append(default)
                bad.append((i, msg))
        if not bad:  # only the batch call fails: blame the batch
            msg = failure(r, exc, batch, None)
            if not explicit:
                raise RewardError(msg) from None
            return [default] * n, [(i, msg) for i in range(n)], 0
        if len(bad) == n > 1 and not explicit:  # every sample fails: the function is broken
            raise RewardError(f"{bad[0][1]} (and on every other sample of the batch of {n})")
        return vals, bad, gave_up

    def _total(self, per_fn: dict[str, list[float | None]], batch: Batch,
               failures: dict[str, list[tuple[int, str]]]) -> list[float]:
        n = len(batch[1])
        total: list[float] = []
        for i in range(n):
            got = [(r.spec.weight, per_fn[r.name][i]) for r in self.rewards if per_fn[r.name][i] is not None]
            if got:
                total.append(float(sum(w * v for w, v in got)))
            elif self.default is not None:
                total.append(float(self.default))
            else:
                msg = (f"every reward returned None for sample {i} ({', '.join(self.names)}) "
                       f"{sample_text(batch, i)}; make one return a number there, or give such samples a reward "
                       "with `grpo.reward_default` in the recipe")
                if not self.collect_errors:
                    raise RewardError(msg)
                failures.setdefault("<total>", []).append((i, msg))
                total.append(float("nan"))
        return total


def _check_batch(prompts: Sequence, completions: Sequence, completion_ids: Sequence | None,
                 columns: dict[str, Sequence]) -> Batch:
    n = len(completions)
    if len(prompts) != n:
        raise RewardError(f"score(): {len(prompts)} prompts for {n} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise RewardError(f"score(): {len(completion_ids)} completion_ids for {n} completions")
    for k, v in columns.items():
        if len(v) != n:
            raise RewardError(f"score(): column {k!r} has {len(v)} values for {n} completions")
    return (list(prompts), list(completions), None if completion_ids is None else list(completion_ids),
            {k: list(v) for k, v in columns.items()})


_PROCESS_CACHE: dict[tuple, ResolvedReward] = {}


def _process_call(spec: RewardSpec, base_dir: str | None, key: str, batch: Batch) -> tuple[Any, float]:
    """Worker side of ``parallel="process"``: resolve once per process, call, time."""
    ck = (repr(spec), base_dir, key)
    if ck not in _PROCESS_CACHE:
        _PROCESS_CACHE[ck] = resolve(spec, base_dir, None, key=key)
    r = _PROCESS_CACHE[ck]
    t0 = time.perf_counter()
    out = r(*batch)
    if not isinstance(out, list):
        out = list(out)
    return out, time.perf_counter() - t0
