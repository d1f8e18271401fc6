"""GGUF import (rlkit/model/gguf.py): a GGUF written from the tiny model comes back as the same model
(exactly from F32 tensors, within Q8_0's rounding from quantised ones), is converted once and reused,
loads through a recipe's model.path, and a type transformers cannot dequantise is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlkit.errors import UserError
from rlkit.model.gguf import default_folder, import_gguf
from tests.helpers import ROOT

PROBE = "12+7=19 答案是12"


def rlkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def write_gguf(model_dir: Path, out: Path, quant: str | None = None, add_bos: bool = False) -> Path:
    """The Qwen2 model in `model_dir` as a GGUF file (llama.cpp's tensor names and tokenizer keys);
    `quant`: the 2-D weights in this ggml type (Q8_0, or Q8_K, which nothing dequantises); `add_bos`:
    the file says BOS (its first token here) begins every text, as Gemma's GGUFs do."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    c = model.config
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in tok.all_special_tokens else gguf.TokenType.NORMAL
                       for t, _ in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if add_bos:
        w.add_bos_token_id(0)
        w.add_add_bos_token(True)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    kind = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name, array = names.get_name(key, try_suffixes=(".weight", ".bias")), value.numpy().astype(np.float32)
        if kind is None or array.ndim != 2:
            w.add_tensor(name, array)
        elif quant == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:  # bytes of the right size for a type with no dequantiser
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(PROBE, return_tensors="pt").input_ids
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {q or "F32": write_gguf(tiny_model, d / f"tiny-{q or 'F32'}.gguf", q) for q in (None, "Q8_0", "Q8_K")}


def test_an_f32_gguf_comes_back_as_the_same_model(tiny_model, tiny_gguf, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = import_gguf(tiny_gguf["F32"])
    assert out == default_folder(tiny_gguf["F32"]) and out.parent == tmp_path / "cache" / "gguf"
    assert torch.equal(logits(out), logits(tiny_model))
    tok, ref = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model)
    assert tok(PROBE).input_ids == ref(PROBE).input_ids
    assert tok.chat_template == ref.chat_template and tok.eos_token == ref.eos_token
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, f"{out.name}.log"]  # nothing half-written
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(tiny_gguf["F32"]) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_quantised_gguf_is_dequantised(tiny_model, tiny_gguf, tmp_path):
    got, want = logits(import_gguf(tiny_gguf["Q8_0"], tmp_path / "q8")), logits(tiny_model)
    assert not torch.equal(got, want)  # the weights went through Q8_0
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_the_files_add_bos_token_is_kept(tiny_model, tmp_path):
    """transformers' GGUF tokenizer drops `tokenizer.ggml.add_bos_token`; Gemma is lost without its BOS."""
    from transformers import AutoTokenizer

    bos = AutoTokenizer.from_pretrained(import_gguf(write_gguf(tiny_model, tmp_path / "bos.gguf", add_bos=True),
                                                    tmp_path / "out"))
    plain = AutoTokenizer.from_pretrained(tiny_model)
    assert bos(PROBE).input_ids == [0] + plain(PROBE).input_ids
    assert bos(PROBE, add_special_tokens=False).input_ids == plain(PROBE).input_ids


def test_a_type_transformers_cannot_dequantise_is_one_line(tiny_gguf, tmp_path):
    with pytest.raises(UserError) as e:
        import_gguf(tiny_gguf["Q8_K"], tmp_path / "q8k")
    message = str(e.value)
    assert "\n" not in message and "tiny-Q8_K.gguf" in message and "cannot read or dequantise" in message
    assert [p.name for p in tmp_path.iterdir()] == ["q8k.log"]  # nothing half-written
    with pytest.raises(UserError, match="no such GGUF file"):
        import_gguf(tmp_path / "missing.gguf")
    out = rlkit("import-gguf", str(tiny_gguf["Q8_K"]), "--out", str(tmp_path / "cli"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "cannot read or dequantise" in out.stderr


def test_a_recipe_names_a_gguf_and_the_run_gets_its_folder(tiny_gguf, tmp_path, monkeypatch):
    """model.path naming a .gguf stays as written in the recipe; at launch it is the imported folder."""
    from rlkit.model.gguf import resolve_models
    from rlkit.stages import load

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    cfg = load("sft", "recipes/tiny-sft.yaml", [f"model.path={tiny_gguf['F32']}", "model.build_tiny_if_missing=null"])
    assert cfg.model.path == str(tiny_gguf["F32"]) and not (tmp_path / "cache").exists()
    resolved = resolve_models(cfg)
    assert Path(resolved.model.path) == default_folder(tiny_gguf["F32"]) and resolved.data == cfg.data
    assert (Path(resolved.model.path) / "config.json").is_file()
    out = rlkit("sft", "recipes/tiny-sft.yaml", f"model.path={tmp_path / 'nope.gguf'}",
                "model.build_tiny_if_missing=null", f"output_dir={tmp_path / 'run'}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "model.path" in out.stderr and "nope.gguf: no such GGUF file" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_distillation_teacher_is_one_of_the_models_a_recipe_names(tiny_gguf, tiny_model, tmp_path, monkeypatch):
    """The recipe type lists its models (the student, a teacher): each .gguf among them is imported
    at launch, and each path is checked before launch under its own key."""
    import dataclasses

    from rlkit.model.checks import check_model
    from rlkit.model.gguf import resolve_models
    from rlkit.stages import load

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    cfg = load("distill", "recipes/tiny-grpo.yaml", [f"model.path={tiny_model}",
                                                      f"distill.teacher.path={tiny_gguf['F32']}"])
    assert list(cfg.models()) == ["model", "distill.teacher"]
    assert list(load("grpo", "recipes/tiny-grpo.yaml").models()) == ["model"]
    resolved = resolve_models(cfg)
    assert Path(resolved.distill.teacher.path) == default_folder(tiny_gguf["F32"]) and resolved.model == cfg.model
    check_model(resolved)
    gone = dataclasses.replace(cfg.distill.teacher, path=str(tmp_path / "absent"))
    with pytest.raises(UserError, match=r"^distill\.teacher\.path: .*absent is not a model directory"):
        check_model(resolved.with_models({"distill.teacher": gone}))


def test_import_gguf_says_where_in_one_line(tiny_gguf, tmp_path):
    out = rlkit("import-gguf", str(tiny_gguf["F32"]), "--out", str(tmp_path / "m"))
    assert out.returncode == 0 and out.stdout == f"rlkit import-gguf: {tmp_path / 'm'}\n" and out.stderr == ""
