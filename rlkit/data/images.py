"""Images in rows, for vision-language models: read and checked with the rows, rendered by the
model's processor.

Rows bring images as users have them: TRL's `image` (one) or `images` (a list) column of PIL
images, paths, or `{"bytes", "path"}` dicts (a datasets `Image` column), and LLaMA-Factory's
`images` list of paths with one `<image>` in the text per image (`dataset_info.json` may rename
the column: `columns.images`). In messages an image is a content part (`{"type": "image"}`, the
chat templates' form) or an `<image>` in a string; a row whose text names no image gets its
images at the start of its first user turn, as TRL puts them. A relative path is read from the
data file's folder, else from the working folder.

`row_images` and `count_placeholders` check a row when it is loaded (a missing file, an image
PIL cannot read, a placeholder count that is not the image count: one line naming the row);
`image_parts` gives the turns the chat template renders; `ImageInputs` (the driver's, around the
model's processor) turns a rendered piece of text and its images into token ids, one image token
per image feature as the model expects, and the images of a micro-batch into the model's pixel
inputs (`image.`-prefixed keys of a `MicroBatch`, passed to the model under their own names).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

PLACEHOLDER = "<image>"  # LLaMA-Factory's (and TRL's text) mark of where an image goes
IMAGE_COLUMNS = ("images", "image")  # TRL names either; LLaMA-Factory `images`
PREFIX = "image."  # micro-batch keys of the model's image inputs (pixel_values -> image.pixel_values)


class ImageRowError(ValueError):
    """A problem with one row's images; the loader adds the file and the row."""


def row_images(row: dict[str, Any], column: str | None, base_dir: str) -> list[Any]:
    """The row's images, checked: each a path that exists and PIL reads (made absolute) or an
    image object; [] for a row without any. `column`: the images column a dataset_info entry
    names (None: `images` or `image`)."""
    columns = (column,) if column else IMAGE_COLUMNS
    present = [c for c in columns if row.get(c) is not None]
    if len(present) > 1:
        raise ImageRowError(f"has both {present[0]!r} and {present[1]!r}: give the images in one column")
    if not present:
        return []
    col = present[0]
    value = row[col]
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_checked(item, col, i, base_dir) for i, item in enumerate(items, 1)]


def _checked(item: Any, col: str, i: int, base_dir: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, dict) and (item.get("bytes") or item.get("path")):  # a datasets Image column, undecoded
        if item.get("bytes"):
            try:
                return Image.open(io.BytesIO(item["bytes"]))
            except (OSError, UnidentifiedImageError) as e:
                raise ImageRowError(f"field {col!r} item {i}: its bytes are no image PIL can read ({e})") from None
        item = item["path"]
    if not isinstance(item, str) or not item:
        raise ImageRowError(f"field {col!r} item {i} is {type(item).__name__} (expected an image path or a PIL image)")
    path = item if os.path.isabs(item) else next(
        (p for p in (os.path.join(base_dir, item), item) if os.path.exists(p)), os.path.join(base_dir, item))
    if not os.path.isfile(path):
        raise ImageRowError(f"field {col!r} item {i}: image {item} not found (looked in {base_dir or '.'} and the "
                            "working folder)")
    try:
        with Image.open(path) as im:
            im.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as e:
        raise ImageRowError(f"field {col!r} item {i}: {item} is no image PIL can read ({str(e)[:120]})") from None
    return os.path.abspath(path)


def count_placeholders(messages: Sequence[dict[str, Any]]) -> int:
    """Images the turns name: image parts and `<image>` marks in string contents."""
    n = 0
    for m in messages:
        c = m.get("content")
        n += c.count(PLACEHOLDER) if isinstance(c, str) else sum(p.get("type") == "image" for p in c or ())
    return n


def check_count(named: int, images: int, where: str) -> None:
    """A row with images names each of them once, or none of them (then they go first, as TRL
    puts them). A row without images is text: an `<image>` in it is text too."""
    if named and named != images:
        raise ImageRowError(f"{where} names {named} image{'s' * (named != 1)} ({PLACEHOLDER} or image parts) but the "
                            f"row has {images}: one {PLACEHOLDER} per image, in order")


def image_parts(messages: Sequence[dict[str, Any]], images: int) -> list[dict[str, Any]]:
    """The turns as the chat templates take images: contents as lists of text and image parts,
    an `<image>` mark made a part; with no image named, the row's `images` go first in the first
    user turn."""
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, str):
            pieces = c.split(PLACEHOLDER)
            parts: list[dict[str, Any]] = []
            for k, text in enumerate(pieces):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            c = parts
        out.append({**m, "content": list(c)})
    if images and not count_placeholders(out):
        first = next(i for i, m in enumerate(out) if m["role"] == "user")
        out[first]["content"] = [{"type": "image"}] * images + out[first]["content"]
    return out


def content_parts(parts: list, col: str, i: int, role: Any) -> str | list[dict[str, Any]]:
    """A turn's content given as parts (the chat templates' form): text parts and, outside the
    assistant's turns, image parts; text alone is joined into a string."""
    out = []
    for k, part in enumerate(parts, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image" and role != "assistant":
            out.append({"type": "image"})  # the image itself is the row's images column, in order
        elif kind == "image":
            raise ImageRowError(f"field {col!r} item {i}: an assistant turn cannot hold an image (part {k}): "
                                "images go in the user's turns")
        else:
            raise ImageRowError(f"field {col!r} item {i} part {k} must be {{'type': 'text', 'text': ...}} or "
                                "{'type': 'image'}")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def load_image(ref: Any):
    """A PIL image in RGB from a checked reference (`row_images`)."""
    from PIL import Image

    image = ref if isinstance(ref, Image.Image) else Image.open(ref)
    return image.convert("RGB") if image.mode != "RGB" else image


class ImageInputs:
    """The model's processor, for the driver: the token ids of a piece of rendered text with its
    images, and a micro-batch's pixel inputs."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.token = getattr(processor, "image_token", None) or PLACEHOLDER  # what the chat template writes
        self.token_id = processor.tokenizer.convert_tokens_to_ids(self.token)

    def count(self, text: str) -> int:
        """Images a piece of rendered text places."""
        return text.count(self.token)

    def encode(self, text: str, images: Sequence[Any]) -> list[int]:
        """Token ids of `text` with its image marks expanded for `images` (the processor's)."""
        pictures = [load_image(r) for r in images]
        out = self.processor(text=[text], images=[pictures], add_special_tokens=False)
        ids = out["input_ids"][0]
        return list(ids.tolist() if hasattr(ids, "tolist") else ids)

    def pixels(self, per_row: Sequence[Sequence[Any]], input_ids: Any = None) -> dict[str, Any]:
        """The image processor's inputs for the rows' images, in token order, keys prefixed
        `image.` (rows without images add none). With the batch's `input_ids`, also the token
        types a model that asks for them reads (Qwen2-VL's `mm_token_type_ids`: 1 on image tokens,
        for its 3-D positions), as its processor would give them."""
        loaded: dict[str, Any] = {}  # by path: a GRPO group's rows share their prompt's images

        def image(ref: Any) -> Any:
            if not isinstance(ref, str):
                return load_image(ref)
            if ref not in loaded:
                loaded[ref] = load_image(ref)
            return loaded[ref]

        rows = [[image(r) for r in refs] for refs in per_row if refs]
        if not rows:
            return {}
        out = dict(self.processor.image_processor(images=rows, return_tensors="pt"))
        if input_ids is not None and "mm_token_type_ids" in getattr(self.processor, "model_input_names", ()):
            out["mm_token_type_ids"] = (input_ids == self.token_id).long()
        return {PREFIX + k: v for k, v in out.items()}


def model_image_inputs(batch: Any) -> dict[str, Any]:
    """The model's own names for a micro-batch's image inputs."""
    return {k[len(PREFIX):]: v for k, v in batch.items() if k.startswith(PREFIX)}
