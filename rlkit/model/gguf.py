"""GGUF checkpoints (llama.cpp's format) as models: dequantised once into a cached HF folder.

`model.path` (and `rlkit eval`'s model) may name a `.gguf` file: `import_gguf` reads it with
transformers' GGUF loader (the `gguf` package), dequantises every tensor to fp32 and saves a
plain HF folder (config, safetensors, tokenizer and its chat template, generation config) under
`cache_dir()/gguf/<name>-<digest>/` (the loaders' output in `<name>-<digest>.log` beside it); the
tokenizer adds BOS / EOS where the GGUF says llama.cpp does. The digest is the file's content hash,
so a changed file gets a new folder and an unchanged one is converted once. The folder is written
beside its place and renamed into it: an interrupted import leaves nothing that looks finished.
`rlkit import-gguf FILE --out DIR` writes it where the user says.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlkit import console
from rlkit.errors import UserError

log = logging.getLogger("rlkit")
CACHE_ENV = "RLKIT_CACHE"  # rlkit's cache root (default ~/.cache/rlkit)
SUFFIX = ".gguf"


def cache_dir() -> Path:
    """rlkit's cache root: $RLKIT_CACHE, else ~/.cache/rlkit."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlkit").expanduser()


def is_gguf(path: str | Path | None) -> bool:
    return path is not None and str(path).lower().endswith(SUFFIX)


def digest(path: Path, length: int = 16) -> str:
    """The first `length` hex digits of the file's sha256."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:length]


def default_folder(path: str | Path) -> Path:
    src = Path(path).expanduser()
    return cache_dir() / "gguf" / f"{src.name[:-len(SUFFIX)]}-{digest(src)}"


def import_gguf(path: str | Path, out: str | Path | None = None, key: str = "model.path") -> Path:
    """The HF folder of the GGUF file `path` (fp32), converted on the first call and reused after.

    out: the folder to write (default: `default_folder(path)`, in rlkit's cache). Raises
    UserError (naming `key`) for a missing file or one transformers cannot dequantise.
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise UserError(f"{path}: no such GGUF file", key)
    target = Path(out).expanduser() if out is not None else default_folder(src)
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{path}: {target} exists and is not an imported model; remove it or choose another "
                        "folder", key)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with console.output_to(target.parent / f"{target.name}.log"):  # the loaders' progress bars
            _convert(src, tmp, key)
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s: %s dequantised to an fp32 HF folder: %s (reused from now on)", key, src, target)
    return target


def _convert(src: Path, out: Path, key: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=str(src), dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except ImportError as e:
        raise UserError(f"{src}: reading GGUF needs the gguf package ({e}): pip install gguf", key) from None
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{src}: transformers cannot read or dequantise this GGUF ({first[:200]}); convert it "
                        "with llama.cpp's gguf tools to a type it reads (Q4_0/1, Q5_0/1, Q8_0, K-quants, "
                        "F16/F32) or use the HF model", key) from None
    for flag, value in _special_token_flags(src).items():  # transformers' GGUF tokenizer drops them
        if getattr(tokenizer, flag, value) != value:
            setattr(tokenizer, flag, value)  # its post-processor, saved in tokenizer.json
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _special_token_flags(src: Path) -> dict[str, bool]:
    """The GGUF's `tokenizer.ggml.add_bos_token` / `add_eos_token`: whether llama.cpp puts BOS / EOS
    around every text. Gemma's GGUFs say add_bos_token (the model is lost without its `<bos>`:
    perplexity ~300 instead of ~16 on plain prose); transformers' loader does not read them."""
    from gguf import GGUFReader

    fields = GGUFReader(src).fields
    return {flag: bool(fields[f"tokenizer.ggml.{flag}"].contents()) for flag in ("add_bos_token", "add_eos_token")
            if f"tokenizer.ggml.{flag}" in fields}


def resolve_models(cfg: Any) -> Any:
    """`cfg` with each model it names (`cfg.models()`: the student, a distillation teacher) whose
    path is a .gguf file replaced by its imported folder (converted now if it is not in the cache
    yet). Runs at launch, before anything reads a model: what a recipe names is kept as written until then."""
    from dataclasses import replace

    ggufs = {key: replace(model, path=str(import_gguf(model.path, key=f"{key}.path")))
             for key, model in cfg.models().items() if is_gguf(model.path)}
    return cfg.with_models(ggufs) if ggufs else cfg


def add_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = sub.add_parser("import-gguf", help="dequantise a GGUF model into an HF folder (fp32) that rlkit trains",
                       description="read a llama.cpp GGUF file with transformers, dequantise it to fp32 and save an "
                                   "HF model folder (config, safetensors, tokenizer, chat template)")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("--out", default=None, help=f"the folder to write (default: the cache, ${CACHE_ENV}/gguf/...)")
    p.set_defaults(handler=_run)


def _run(args) -> int:  # noqa: ANN001
    if not is_gguf(args.gguf):
        raise UserError(f"{args.gguf}: not a .gguf file")
    print(f"rlkit import-gguf: {import_gguf(args.gguf, args.out, key='import-gguf')}")
    return 0
