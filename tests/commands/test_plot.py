"""`rlkit plot`: the PNGs are images of the expected size, with one panel per group of metrics
the runs logged (counted from the pixels), several runs overlaid in their own colours."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from rlkit.commands import plot
from rlkit.config import LoggingConfig
from rlkit.run.metrics import MetricsLogger
from tests.helpers import rlkit_cli

W, H = int(plot.PANEL_W * plot.DPI), int(plot.PANEL_H * plot.DPI)  # one panel, in pixels
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1


def _grpo_run(folder, steps=12, gain=1.0):
    """A GRPO-shaped metrics.jsonl, written by the real logger."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("stage: grpo\n")
    log = MetricsLogger(folder, LoggingConfig(tensorboard=False, progress="none"), steps)
    log.log(0, {"eval/reward": 0.2, "eval/exact_match": 0.2})
    for s in range(1, steps + 1):
        r = min(1.0, 0.2 + gain * 0.05 * s)
        log.log(s, {"reward/mean": (r + 1.0) / 2, "reward/exact_match/mean": r, "reward/exact_match/std": 0.1,
                    "reward/format/mean": 1.0, "train/loss": 0.1 / s, "train/kl_mean": 0.01 * s, "train/lr": 1e-5,
                    "train/clip_frac": 0.0, "completion/len_mean": 4.0, "completion/len_max": 6.0,
                    "time/generate": 0.1, "time/train": 0.2, "time/sync": 0.05, "time/step": 0.35,
                    "rollout/busy_fraction": 0.6, "rollout/busy_fraction_min": 0.5, "time/sync_share": 0.14})
        if s % 4 == 0:
            log.log(s, {"eval/reward": r, "eval/exact_match": r})
    log.close()
    return folder


def _sft_run(folder, steps=100):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("stage: sft\nmodel:\n  path: m\n")
    log = MetricsLogger(folder, LoggingConfig(tensorboard=False, progress="none"), steps)
    for s in range(1, steps + 1):
        log.log(s, {"train/loss": 2.0 * math.exp(-s / 30) + 0.05 * (s % 3), "train/lr": 1e-4, "time/step": 0.05,
                    "mix/explain": 0.8 if s < 50 else 0.4, "mix/reasoning": 0.2 if s < 50 else 0.6})
    log.log(steps, {"eval/loss": 0.5, "eval/ppl": 1.6})
    log.close()
    return folder


def _dpo_run(folder, steps=60):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("stage: dpo\nmodel:\n  path: m\n")
    log = MetricsLogger(folder, LoggingConfig(tensorboard=False, progress="none"), steps)
    for s in range(1, steps + 1):
        margin = 1 - math.exp(-s / 20)
        log.log(s, {"train/loss": 0.69 - 0.3 * margin, "train/lr": 1e-4, "time/step": 0.3,
                    "train/rewards/chosen": 0.1 * margin, "train/rewards/rejected": -0.9 * margin,
                    "train/rewards/margins": margin, "train/rewards/accuracies": 0.5 + 0.4 * margin})
        if s % 20 == 0:
            log.log(s, {"eval/loss": 0.69 - 0.28 * margin, "eval/rewards/accuracies": 0.5 + 0.35 * margin,
                        "eval/rewards/margins": 0.9 * margin})
    log.close()
    return folder


def _panels_in(image: Image.Image, columns: int) -> int:
    """How many grid cells hold a panel: an axes frame is a dark line across most of its cell."""
    px = np.asarray(image.convert("RGB")).astype(int)
    dark = px.sum(axis=2) < 150
    rows = image.height // H
    count = 0
    for r in range(rows):
        for c in range(columns):
            cell = dark[r * H:(r + 1) * H, c * W:(c + 1) * W]
            count += bool((cell.sum(axis=1) > 0.6 * W).any())
    return count


def _has(image: Image.Image, rgb: tuple[int, int, int]) -> bool:
    px = np.asarray(image.convert("RGB")).astype(int)
    return bool((np.abs(px - np.array(rgb)).sum(axis=2) < 12).sum() > 50)


def test_one_grpo_run_gives_one_png_per_panel_and_a_grid(tmp_path):
    run = _grpo_run(tmp_path / "grpo")
    written = plot.plot_runs([run], tmp_path / "plots")
    names = [p.stem for p in written]
    assert names == ["reward", "held_out", "loss", "kl", "clip", "length", "time", "utilisation", "lr", "curves"]
    for path in written[:-1]:
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size == (W, H), path
            assert _panels_in(im, 1) == 1, path
            assert _has(im, BLUE), f"{path} has no curve"
    with Image.open(written[-1]) as grid:
        assert grid.size == (3 * W, 3 * H)  # 9 panels in rows of 3
        assert _panels_in(grid, 3) == 9
        assert grid.text["Description"] == "panels: " + " ".join(names[:-1])


def test_an_sft_run_draws_only_what_it_logged(tmp_path):
    written = plot.plot_runs([_sft_run(tmp_path / "sft")], tmp_path / "out")
    assert [p.stem for p in written] == ["held_out", "loss", "time", "lr", "mix", "curves"]
    with Image.open(written[-1]) as grid:
        assert grid.size == (3 * W, 2 * H) and _panels_in(grid, 3) == 5


def test_a_dpo_run_draws_its_preference_accuracy_and_margins(tmp_path):
    written = plot.plot_runs([_dpo_run(tmp_path / "dpo")], tmp_path / "out")
    assert [p.stem for p in written] == ["loss", "preference", "margin", "time", "lr", "curves"]
    for path in written[1:3]:
        with Image.open(path) as im:
            assert _has(im, BLUE) and _has(im, ORANGE), path  # train and held-out (or chosen) curves


def test_several_runs_are_overlaid_and_a_folder_of_runs_is_split_by_stage(tmp_path):
    a, b = _grpo_run(tmp_path / "a" / "run"), _grpo_run(tmp_path / "b" / "run", gain=0.5)
    written = plot.plot_runs([a, b], tmp_path / "both")
    reward = next(p for p in written if p.stem == "reward")
    with Image.open(reward) as im:
        assert _has(im, BLUE) and _has(im, ORANGE)  # one colour per run
    assert plot._label(a, [a, b]) == "a/run"  # runs that share a folder name are told apart by their parent

    demo = tmp_path / "demo"
    _sft_run(demo / "sft")
    _grpo_run(demo / "grpo")
    out = rlkit_cli("plot", str(demo))
    assert out.returncode == 0, out.stderr
    assert (demo / "plots" / "sft" / "curves.png").is_file() and (demo / "plots" / "grpo" / "curves.png").is_file()
    assert out.stdout.splitlines() == [
        f"rlkit plot: {demo / 'plots' / 'grpo'}/curves.png and one PNG per panel (reward, held_out, loss, kl, clip, "
        "length, time, utilisation, lr)",
        f"rlkit plot: {demo / 'plots' / 'sft'}/curves.png and one PNG per panel (held_out, loss, time, lr, mix)"]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist: give the output_dir of an rlkit sft / grpo run"),
    (lambda p: p.mkdir(), "has no metrics.jsonl (nor do its subfolders)"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("")), "metrics.jsonl is empty"),
])
def test_a_folder_without_metrics_is_one_line_exit_2(tmp_path, make, message):
    make(tmp_path / "run")
    out = rlkit_cli("plot", str(tmp_path / "run"))
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
