"""A tiny vision-language model and a visual task, built offline (no model or data hub).

`build_tiny_vlm(out_dir)` writes an Idefics3 (SmolVLM's architecture: a SigLIP-style vision
tower, the pixel-shuffle connector, a llama text model) with random weights, its processor (the
PIL image processor, so no torchvision) and a SmolVLM-style chat template: an HF folder that
`AutoProcessor` and `AutoModelForImageTextToText` load, and vLLM's CPU build serves.

`write_shape_task(out_dir, seed)` draws one shape (square, circle or triangle) in one of four
colours on a grey background with PIL and asks for its colour: a question a model cannot answer
without the image (a text-only model is right a quarter of the time). The held-out images are
drawn from their own seed and none of them is a training image. Rows come in TRL's
conversational form (a `prompt` of messages with an image part, an `image` path, the `answer`)
and as SFT `messages` with an `images` list.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from rlkit.tiny import build_tokenizer

# Idefics3's processor looks these up in the tokenizer: the image placeholder and what surrounds
# it, the end of a turn, and the tile tags (none used here: one global view per image).
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]
# SmolVLM's template: a user turn of text and image parts, `<image>` where an image goes.
VLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
QUESTION = "What colour is the shape?"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")


@dataclass(frozen=True)
class TinyVLMSize:
    """Shape of the tiny Idefics3: `image // patch` squared patches, pixel-shuffled by `scale`
    into (image / patch / scale) ** 2 image tokens per image. Heads of 32 (vLLM's CPU attention)."""

    image: int = 64
    patch: int = 16
    scale: int = 2
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512

    @property
    def image_seq_len(self) -> int:
        return (self.image // self.patch) ** 2 // self.scale ** 2


def build_tiny_vlm(out_dir: str | Path, seed: int = 0, size: TinyVLMSize = TinyVLMSize(), tied: bool = False) -> Path:
    """Write a random-init Idefics3ForConditionalGeneration, its processor and chat template to
    `out_dir` (safetensors); `tied`: the lm_head shares the embeddings (said in the text config)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.utils import logging as hf_logging

    tokenizer = build_tokenizer(size.vocab, seed)
    tokenizer.add_tokens(IMAGE_TOKENS, special_tokens=True)
    tokenizer.eos_token = "<end_of_utterance>"
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size.image},
                                       max_image_size={"longest_edge": size.image})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=size.image_seq_len,
                                  chat_template=VLM_CHAT_TEMPLATE)
    config = Idefics3Config(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=size.scale,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied,
        vision_config={"hidden_size": size.vision_hidden, "intermediate_size": 2 * size.vision_hidden,
                       "num_hidden_layers": size.vision_layers, "num_attention_heads": size.vision_heads,
                       "image_size": size.image, "patch_size": size.patch},
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": size.hidden,
                     "intermediate_size": size.intermediate, "num_hidden_layers": size.layers,
                     "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads,
                     "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": tied,
                     "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "bos_token_id": None},
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # saving compares with a default Idefics3Config (its pad id is off its vocab)
    try:
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
    finally:
        hf_logging.set_verbosity(level)
    return out


def draw_shape(rng: random.Random, size: int = 64):
    """A PIL image of one shape in one colour, at a random place and size; returns (image, colour)."""
    from PIL import Image, ImageDraw

    colour = rng.choice(sorted(COLOURS))
    shape = rng.choice(SHAPES)
    grey = rng.randint(110, 150)
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    side = rng.randint(size // 4, size // 2)
    x, y = rng.randint(0, size - side - 1), rng.randint(0, size - side - 1)
    box = (x, y, x + side, y + side)
    draw = ImageDraw.Draw(image)
    if shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    else:
        draw.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=COLOURS[colour])
    return image, colour


def write_shape_task(out_dir: str | Path, seed: int = 0, n_train: int = 512, n_eval: int = 64,
                     size: int = 64) -> dict[str, Path]:
    """Write the shape-colour task: PNGs under `images/` and four JSONL files (paths relative to
    `out_dir`): `sft_train` / `sft_eval` (messages + images) and `grpo_train` / `grpo_eval`
    (TRL's prompt + image + answer). No held-out image equals a training image."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for split, n, split_seed in (("train", n_train, seed), ("eval", n_eval, seed + 10_000)):
        rng, rows = random.Random(split_seed), []
        while len(rows) < n:
            image, colour = draw_shape(rng, size)
            digest = hashlib.sha256(image.tobytes()).hexdigest()
            if digest in seen:  # the same picture twice (or in both splits): draw another
                continue
            seen.add(digest)
            name = f"images/{split}-{len(rows):05d}.png"
            image.save(out / name)
            rows.append((name, colour))
        splits[split] = rows
    paths = {}
    for split, rows in splits.items():
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        sft = [{"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": colour}]}],
                "images": [name]} for name, colour in rows]
        grpo = [{"prompt": [user], "image": name, "answer": colour} for name, colour in rows]
        for stage, data in (("sft", sft), ("grpo", grpo)):
            paths[f"{stage}_{split}"] = out / f"{stage}_{split}.jsonl"
            paths[f"{stage}_{split}"].write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return paths
