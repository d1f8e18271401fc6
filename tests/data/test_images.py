"""Rows with images, in the forms users bring them (TRL's `image` / `images` columns of paths, PIL
images or datasets' bytes; LLaMA-Factory's `images` list with `<image>` marks and its dataset_info
`columns.images`): loaded and checked with one line naming the row, rendered by the tiny VLM's
processor into one image token per image feature, never trained on, and batched into the pixel
inputs the model takes."""

from __future__ import annotations

import io
import json

import pytest
import torch

from rlkit.data.formats import load_prompts, load_rows
from rlkit.errors import DataError
from rlkit.sft.config import SFTDataConfig

QUESTION = "What colour is it?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from rlkit.config import ModelConfig
    from rlkit.model.load import load_image_inputs, load_tokenizer
    from rlkit.tiny_vlm import build_tiny_vlm

    cfg = ModelConfig(path=str(build_tiny_vlm(tmp_path_factory.mktemp("vlm"))))
    tokenizer = load_tokenizer(cfg)
    return tokenizer, load_image_inputs(cfg, tokenizer)


def png(path, colour=(200, 30, 30), size=(64, 64)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def user_parts(*parts):
    return {"role": "user", "content": list(parts)}


def test_the_forms_users_bring_load_to_one_shape(tmp_path):
    png(tmp_path / "img" / "a.png")
    png(tmp_path / "img" / "b.png", (30, 30, 200))
    a, b = str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")
    # TRL: conversational rows with image parts and an `image` column (one), relative to the data file
    trl = load_rows(write(tmp_path / "trl.jsonl", [{"messages": [
        user_parts({"type": "image"}, {"type": "text", "text": QUESTION}),
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "image": "img/a.png"}])).rows[0]
    assert trl["images"] == [a] and trl["image"] == "img/a.png"  # the column as it came stays (TRL's rewards read it)
    assert trl["messages"] == [user_parts({"type": "image"}, {"type": "text", "text": QUESTION}),
                               {"role": "assistant", "content": "red"}]  # text parts alone become a string
    # LLaMA-Factory: <image> marks in sharegpt text, an `images` list, through dataset_info's columns.images
    (tmp_path / "mllm.json").write_text(json.dumps([{"conversations": [
        {"from": "human", "value": "<image>and<image>: which is red?"}, {"from": "gpt", "value": "the first"}],
        "pictures": ["img/a.png", "img/b.png"]}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mllm_demo": {
        "file_name": "mllm.json", "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "pictures"}}}))
    lf = load_rows(str(tmp_path), dataset="mllm_demo").rows[0]
    assert lf["images"] == [a, b] and lf["pictures"] == ["img/a.png", "img/b.png"]
    assert lf["messages"][0]["content"] == "<image>and<image>: which is red?"
    # alpaca rows with an <image> in the instruction, and GRPO prompt rows (TRL's `image` + `answer`)
    alpaca = load_rows(write(tmp_path / "alpaca.jsonl", [
        {"instruction": "<image>颜色?", "output": "红", "images": [a]}])).rows[0]
    assert alpaca["images"] == [a] and alpaca["instruction"] == "<image>颜色?"
    prompt = load_prompts(write(tmp_path / "grpo.jsonl", [
        {"prompt": [user_parts({"type": "image"}, {"type": "text", "text": QUESTION})], "image": a,
         "answer": "red"}])).rows[0]
    assert prompt["images"] == [a] and prompt["answer"] == "red"


def test_images_as_objects_and_bytes_as_datasets_give_them(tmp_path):
    from datasets import Dataset, Image
    from PIL import Image as PILImage

    png(tmp_path / "a.png")
    ds = Dataset.from_dict({"prompt": [QUESTION, QUESTION], "answer": ["red", "red"],
                            "image": [str(tmp_path / "a.png")] * 2}).cast_column("image", Image())
    ds.save_to_disk(tmp_path / "saved")
    rows = load_prompts(str(tmp_path / "saved")).rows
    assert isinstance(rows[0]["images"][0], PILImage.Image) and rows[0]["images"][0].size == (64, 64)
    buf = io.BytesIO()
    PILImage.new("RGB", (8, 8)).save(buf, format="PNG")
    ds = Dataset.from_dict({"prompt": [QUESTION] * 2, "answer": ["x"] * 2, "images": [
        [{"bytes": buf.getvalue(), "path": None}], [{"bytes": None, "path": str(tmp_path / "a.png")}]]})
    ds.save_to_disk(tmp_path / "undecoded")
    by_bytes, by_path = load_prompts(str(tmp_path / "undecoded")).rows
    assert by_bytes["images"][0].size == (8, 8) and by_path["images"] == [str(tmp_path / "a.png")]


@pytest.mark.parametrize("row, message", [
    ({"images": ["missing.png"]}, "row 1: field 'images' item 1: image missing.png not found (looked in"),
    ({"images": ["not-an-image.png"]}, "row 1: field 'images' item 1: not-an-image.png is no image PIL can read"),
    ({"images": ["a.png"], "content": "<image><image>which?"},
     "row 1: its text names 2 images (<image> or image parts) but the row has 1: one <image> per image, in order"),
    ({"images": ["a.png"], "image": "a.png"}, "row 1: has both 'images' and 'image': give the images in one column"),
    ({"images": [7]}, "row 1: field 'images' item 1 is int (expected an image path or a PIL image)"),
    ({"images": ["a.png"], "answer_part": {"type": "image"}},
     "row 1: field 'messages' item 2: an assistant turn cannot hold an image (part 1): images go in the user's turns"),
    ({"videos": ["a.mp4"]}, "row 1: has videos: rlkit trains on text and images"),
])
def test_a_bad_image_row_is_one_line_naming_it(tmp_path, row, message):
    png(tmp_path / "a.png")
    (tmp_path / "not-an-image.png").write_text("text, not pixels")
    answer = [row.pop("answer_part")] if "answer_part" in row else "red"
    record = {"messages": [{"role": "user", "content": row.pop("content", "which?")},
                           {"role": "assistant", "content": answer}], **row}
    path = write(tmp_path / "rows.jsonl", [record])
    with pytest.raises(DataError) as e:
        load_rows(path)
    assert message in str(e.value) and str(e.value).startswith(path) and "\n" not in str(e.value)


def test_a_text_row_keeps_an_image_mark_as_text(tmp_path):
    row = load_rows(write(tmp_path / "t.jsonl", [{"instruction": "what does <image> mean in HTML?",
                                                   "output": "nothing"}])).rows[0]
    assert "images" not in row and row["instruction"] == "what does <image> mean in HTML?"


def test_the_processor_renders_image_tokens_that_are_never_trained(tmp_path, vlm):
    from rlkit.sft.run import load_sft_data, micro_batches

    tokenizer, images = vlm
    png(tmp_path / "a.png")
    png(tmp_path / "b.png", (30, 30, 200), (48, 64))
    rows = [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "red"}],
             "images": ["a.png"]},                                             # no mark: the image goes first
            {"messages": [{"role": "user", "content": "<image> then <image>?"},
                          {"role": "assistant", "content": "two"}], "images": ["a.png", "b.png"]},
            {"messages": [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "none"}]}]
    cfg = SFTDataConfig(train=write(tmp_path / "rows.jsonl", rows), cutoff_len=128)
    data = load_sft_data(cfg, tokenizer, 0, images)
    assert data.template == "chat"
    first, second, third = data.train
    text = tokenizer.decode(first["input_ids"])
    assert text.startswith("<|im_start|>User:<fake_token_around_image><global-img><image><image><image><image>"
                           f"<fake_token_around_image>{QUESTION}<end_of_utterance>\nAssistant:")
    for sample, n in ((first, 1), (second, 2), (third, 0)):
        ids, labels = torch.tensor(sample["input_ids"]), torch.tensor(sample["labels"])
        assert int((ids == images.token_id).sum()) == 4 * n                    # 4 tokens per image
        assert bool((labels[ids == images.token_id] == -100).all())
        trained = tokenizer.decode([t for t in sample["labels"] if t != -100])
        assert trained == {1: " red", 2: " two", 0: " none"}[n] + "<end_of_utterance>"
    assert "images" not in third
    batch, = micro_batches(data.train, 3, False, data.pad_id, images)
    assert tuple(batch["image.pixel_values"].shape) == (2, 2, 3, 64, 64)       # rows with images, up to 2 each
    assert batch["image.pixel_attention_mask"][0, 1].sum() == 0                # the first row's padding image


def test_what_cannot_be_rendered_is_refused_before_launch(tmp_path, vlm):
    from rlkit.sft.run import load_sft_data

    tokenizer, images = vlm
    png(tmp_path / "a.png")
    path = write(tmp_path / "rows.jsonl", [{"messages": [
        {"role": "user", "content": "<image>" + " word" * 4}, {"role": "assistant", "content": "red"}],
        "images": ["a.png"]}])
    cases = [(SFTDataConfig(train=path, cutoff_len=256, packing=True), images,
              "row 1 has images, and rows with images are not packed (the image features follow the rows): set "
              "data.packing: false"),
             (SFTDataConfig(train=path, cutoff_len=256, template="alpaca"), images,
              "row 1: a row with images needs the chat template (the model's places the images), not alpaca"),
             (SFTDataConfig(train=path, cutoff_len=256), None,
              "row 1: the row has images but the model has no image processor (a text-only model)"),
             (SFTDataConfig(train=path, cutoff_len=32), images,
              "and a prompt with images is not cut: raise cutoff_len")]
    for cfg, given, message in cases:
        with pytest.raises(DataError) as e:
            load_sft_data(cfg, tokenizer, 0, given)
        assert message in str(e.value) and str(e.value).startswith(path), str(e.value)
