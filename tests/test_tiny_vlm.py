"""The tiny vision-language model and the shape-colour task, built offline: transformers' Auto
classes load the model, the processor puts each image's tokens where the chat template says, the
image reaches the language model and both towers train, and the task needs the image (a
text-only model cannot tell the colours apart) with held-out images never seen in training."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from rlkit.tiny_vlm import COLOURS, QUESTION, TinyVLMSize, build_tiny_vlm, draw_shape, write_shape_task

USER = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


def _inputs(processor, images, answer=None):
    text = processor.apply_chat_template(USER, add_generation_prompt=True) + (answer or "")
    return processor(text=[text] * len(images), images=[[im] for im in images], return_tensors="pt")


def test_the_auto_classes_load_it_and_the_processor_renders_the_image_tokens(vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm)
    assert model.config.model_type == "idefics3" and type(model).__name__ == "Idefics3ForConditionalGeneration"
    text = processor.apply_chat_template(USER, add_generation_prompt=True)
    assert text == f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:"
    enc = _inputs(processor, [draw_shape(random.Random(0))[0]])
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((enc["input_ids"] == image_id).sum()) == TinyVLMSize().image_seq_len == 4
    assert tuple(enc["pixel_values"].shape[-3:]) == (3, 64, 64)
    assert processor.tokenizer.eos_token == "<end_of_utterance>"


def test_the_image_reaches_the_language_model_and_both_towers_train(vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm)
    rng = random.Random(1)
    first, colour = draw_shape(rng)
    second = next(im for im, c in (draw_shape(rng) for _ in range(50)) if c != colour)
    enc = _inputs(processor, [first, second])
    with torch.no_grad():
        logits = model(**enc).logits[:, -1]
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)  # the same text, other pictures: other outputs
    enc = _inputs(processor, [first], answer=colour)
    out = model(**enc, labels=enc["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert any("vision_model" in name and g.abs().sum() > 0 for name, g in grads.items())
    assert any("text_model" in name and g.abs().sum() > 0 for name, g in grads.items())


def test_the_shape_task_needs_the_image_and_holds_out_its_images(tmp_path):
    from PIL import Image

    paths = write_shape_task(tmp_path, seed=0, n_train=96, n_eval=24)
    rows = {name: [json.loads(x) for x in p.read_text().splitlines()] for name, p in paths.items()}
    assert [len(rows[k]) for k in ("sft_train", "sft_eval", "grpo_train", "grpo_eval")] == [96, 24, 96, 24]
    train = {hashlib.sha256(Image.open(tmp_path / r["image"]).tobytes()).hexdigest() for r in rows["grpo_train"]}
    held = {hashlib.sha256(Image.open(tmp_path / r["image"]).tobytes()).hexdigest() for r in rows["grpo_eval"]}
    assert len(train) == 96 and len(held) == 24 and not train & held
    answers = Counter(r["answer"] for r in rows["grpo_train"])
    assert set(answers) == set(COLOURS) and max(answers.values()) < 0.4 * 96  # a text-only guess: about 1 in 4
    assert {r["prompt"][0]["content"][1]["text"] for r in rows["grpo_train"]} == {QUESTION}  # the text says nothing
    for row in rows["grpo_eval"]:  # the answer is in the picture: its most common non-grey colour
        pixels = np.asarray(Image.open(tmp_path / row["image"]).convert("RGB")).reshape(-1, 3).tolist()
        shape = Counter(tuple(p) for p in pixels if len(set(p)) > 1).most_common(1)[0][0]
        assert shape == COLOURS[row["answer"]]
    sft, grpo = rows["sft_train"][0], rows["grpo_train"][0]
    assert sft["images"] == [grpo["image"]] and sft["messages"][0] == grpo["prompt"][0]


def test_the_command_builds_the_model_and_the_task(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "tiny-model", str(tmp_path / "m"), "--vlm", "--data",
                          str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == f"tiny vision-language model (Idefics3) written to {tmp_path / 'm'}"
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "d" / "grpo_eval.jsonl").is_file()
