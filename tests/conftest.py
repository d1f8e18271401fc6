"""Shared fixtures: the offline tiny models and the synthetic task, built once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402

from tests.helpers import ROOT, sft_overrides
from tests.sides import learners, process_group, tiny_models  # noqa: F401  (the suite's fixtures)
from tests.workers import once

pytest_plugins = ["tests.workers"]  # the two workers of pytest-xdist: which tests run beside which


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Directory of the tied-embedding tiny Qwen2 (hidden 128, 2 layers, vocab 512)."""
    from rlkit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), "tiny")


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    """Paths of the synthetic arithmetic task (sft_train, sft_eval, grpo_train, grpo_eval)."""
    from rlkit.tiny import write_task_data

    return write_task_data(tmp_path_factory.mktemp("task-data"), seed=0)


CONTAINERS = ("parquet", "csv", "arrow", "jsonl.gz")  # the files users bring besides JSONL


@pytest.fixture(scope="session")
def task_containers(task_data, tmp_path_factory):
    """The synthetic task's four files as parquet, CSV, Arrow (feather) and gzip JSONL copies:
    {extension: {name: path}}, the names of `task_data`."""
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("task-containers")
    copies: dict[str, dict] = {ext: {} for ext in CONTAINERS}
    for name, path in task_data.items():
        if path.suffix != ".jsonl":  # the dataset_info.json that names them
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        table = pa.Table.from_pylist(rows)
        for ext in CONTAINERS:
            copies[ext][name] = out / f"{name}.{ext}"
        pq.write_table(table, copies["parquet"][name])
        pcsv.write_csv(table, copies["csv"][name])
        feather.write_feather(table, copies["arrow"][name])
        with gzip.open(copies["jsonl.gz"][name], "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return copies


@pytest.fixture(scope="session")
def sft_model(tiny_model, task_data, tmp_path_factory):
    """The tiny model after 600 SFT steps (~40 s): it knows some facts and the teacher's three
    answer styles, so an exact-answer reward has signal. Built once for both workers."""

    def build(out):
        import ray

        from rlkit import stages
        from rlkit.sft.run import run_sft

        cfg = stages.load("sft", ROOT / "recipes" / "tiny-sft.yaml",
                          sft_overrides(tiny_model, task_data, out, "train.max_steps=600", "eval.every=0",
                                        "checkpoint.every=0"))
        final = run_sft(cfg)
        assert not ray.is_initialized()
        return final

    return once(tmp_path_factory, "sft-start", build)


def _local_ray() -> None:
    """Start a local Ray instance as a user's would be: its processes do not inherit the allocator
    variables (`MALLOC_*`) that an in-process learner or driver of an earlier test set in this
    process (`accel.apply_env`)."""
    import ray

    if not ray.is_initialized():
        held = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MALLOC_")}
        try:
            ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING",
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        finally:
            os.environ.update(held)


@pytest.fixture()
def ray_local():
    """A local Ray instance for one test (rlkit's own runs start and stop their own otherwise)."""
    import ray

    _local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_module():
    """One local Ray instance for a module's in-process runs: a run finds Ray up, joins it and leaves
    it up (as under `ray job submit`), so the module pays Ray's start (about 3 s) and stop (1.5 s) once.
    For tests that do not test how a run starts or stops its own Ray."""
    import ray

    _local_ray()
    yield
    ray.shutdown()


def marked_env(tag: str, **extra: str) -> dict[str, str]:
    """The environment for an rlkit subprocess, marked so that `left_running(tag)` finds every
    process it starts (Ray's raylet and workers, vLLM's) through their inherited environment."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "RLKIT_TEST_RUN": tag, **extra}


def left_running(tag: str, wait_s: float = 20.0) -> list[str]:
    """Command lines of processes still running `wait_s` seconds after an rlkit run marked `tag`
    ended (none: everything it started has exited)."""
    import time

    from rlkit.actors.reaper import carrying

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in carrying(tag, "RLKIT_TEST_RUN"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
            except OSError:  # gone meanwhile
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


# ------------------------------------------------------------------ the checkout's own run folders



def recipe_run_paths() -> list:
    """The checkout's folders the shipped recipes and the demo write to by default (output_dir and
    the paths they build into, under runs/): what a user's own runs of the README's commands fill."""
    import yaml

    found = {ROOT / "runs" / "tiny", ROOT / "runs" / "tiny-plots"}  # the demo's, besides the recipes'
    for recipe in (ROOT / "recipes").glob("*.yaml"):
        doc = yaml.safe_load(recipe.read_text()) or {}
        for value in (doc.get("output_dir"), (doc.get("model") or {}).get("path")):
            if isinstance(value, str) and value.startswith("runs/"):
                found.add(ROOT / "/".join(value.split("/")[:2]))
    return sorted(found)


def _state(paths: list) -> dict[str, float]:
    out = {}
    for top in paths:
        for p in [top, *(top.rglob("*") if top.is_dir() else [])]:
            try:
                out[str(p)] = p.stat().st_mtime
            except OSError:
                continue
    return out


@pytest.fixture(scope="session", autouse=True)
def checkout_runs_untouched():
    """No test writes into the checkout's run folders (a user's own runs of the README's commands
    live there, and the suite must neither change them nor depend on them)."""
    paths = recipe_run_paths()
    before = _state(paths)
    yield
    after = _state(paths)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"tests wrote into the checkout's run folders: {changed[:10]}"
