"""SFT of a vision-language model for real (Ray, DeepSpeed on gloo): `rlkit sft
recipes/tiny-vlm-sft.yaml` builds the tiny Idefics3 and the shape-colour task offline and teaches
it the colours. Held-out images it never saw: greedy answers from the final folder (loaded as a
user would, with its processor) beat a text-only model (the best it can do is the most common
colour) by far, and fall to that level when the picture is blanked. Then the seed-001 shape on
two ZeRO-3 learners: the vision tower and projector frozen (the defaults), the language model
trained: the final model's vision weights are the starting ones, byte for byte."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.docs import run_rlkit

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def held_out_accuracy(model_dir: Path, data_dir: Path, blank: bool = False) -> float:
    """Greedy exact-colour accuracy on the held-out rows (`blank`: a grey picture instead of theirs)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in (data_dir / "sft_eval.jsonl").read_text().splitlines()]
    right = 0
    for row in rows:
        text = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
        image = Image.new("RGB", (64, 64), (128, 128, 128)) if blank else Image.open(data_dir / row["images"][0])
        enc = processor(text=[text], images=[[image.convert("RGB")]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=10, do_sample=False)
        answer = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        right += answer == row["messages"][1]["content"][0]["text"]
    return right / len(rows)


def test_the_tiny_vlm_learns_what_only_the_image_tells(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    res = run_rlkit("rlkit sft recipes/tiny-vlm-sft.yaml", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wrote the synthetic shape-colour task there" in res.stdout + res.stderr
    run, data = tmp_path / "runs" / "tiny-vlm-sft", tmp_path / "runs" / "tiny-vlm" / "data"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    # the answer is the colour and an end token: a model that guesses among four colours loses ln 4 on one of them
    assert evals[0] > 3 and evals[-1] < 0.05, evals
    answers = Counter(json.loads(x)["messages"][1]["content"][0]["text"] for x in (data / "sft_eval.jsonl").open())
    text_only = max(answers.values()) / sum(answers.values())
    seeing, blind = held_out_accuracy(run / "final", data), held_out_accuracy(run / "final", data, blank=True)
    print(f"\nheld-out colour accuracy: text-only best {text_only:.3f}, SFT {seeing:.3f}, SFT with a blank picture "
          f"{blind:.3f}")
    assert seeing >= 0.9 and seeing > text_only + 0.5 and blind <= text_only + 0.1

    # seed 001's shape: the towers' defaults (frozen), on two ZeRO-3 learners, from the SFT model
    res = run_rlkit("rlkit sft recipes/tiny-vlm-sft.yaml", tmp_path, extra=(
        f"model.path={run / 'final'}", "model.build_tiny_if_missing=null", "model.freeze_vision_tower=true",
        "model.freeze_multi_modal_projector=true", "deepspeed.zero_stage=3", "train.num_learners=2",
        "train.micro_batch_size=8", "train.max_steps=6", "eval.every=3", "output_dir=runs/zero3",
        "logging.tensorboard=false"))
    assert res.returncode == 0, res.stderr[-3000:]
    from safetensors.torch import load_file

    before = load_file(run / "final" / "model.safetensors")
    after = load_file(tmp_path / "runs" / "zero3" / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".text_model." in k or k.startswith("lm_head") for k in changed), sorted(changed)[:5]
    assert any(".vision_model." in k for k in before) and any(".connector." in k for k in before)
    zero3 = [json.loads(x) for x in (tmp_path / "runs/zero3/metrics.jsonl").read_text().splitlines()]
    assert [r["eval/loss"] for r in zero3 if "eval/loss" in r][-1] < 0.1
