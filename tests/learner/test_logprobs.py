"""Token logprobs: selective log-softmax and entropy against direct formulas, temperature scaling."""

import math
import os

import pytest
import torch

from rlkit.learner.logprobs import entropy_from_logits, selective_log_softmax, token_logprobs
from tests.sides import assert_packed_as_padded

D = torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_selective_log_softmax_matches_gather(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    ref = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, ids), ref)
    with pytest.raises(ValueError, match="ids shape"):
        selective_log_softmax(logits, ids[:, :2])


def test_entropy_from_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=D)
    p = logits.softmax(-1)
    ref = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), ref)  # 15 rows in 4 chunks
    # uniform over V=11 -> ln 11
    assert entropy_from_logits(torch.zeros(1, 1, 11)).item() == pytest.approx(math.log(11), rel=1e-6)


def test_token_logprobs_scale_logits_by_temperature(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 230, 41]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float() / 0.7
        logp, entropy = token_logprobs(model, batch, 0.7, with_entropy=True)
    want = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(entropy, -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))


def _full(model, batch, temperature=1.0):
    """The reference: the model's own [B, L, V] logits, log-softmax, gather, entropy."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return logp, -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def _padded_batch():
    ids = torch.tensor([[5, 17, 99, 230, 41, 7, 8], [5, 6, 7, 9, 0, 0, 0]])
    return {"input_ids": ids, "attention_mask": (torch.arange(7) < torch.tensor([[7], [4]])).long()}


@pytest.mark.parametrize("keep_bytes", [0, 2**29], ids=["projected-again", "kept"])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(tiny_model, chunk_tokens, keep_bytes):
    """Chunks of 1, 4 and all tokens, their backward reading what the forward kept or projecting
    each chunk again: logprobs and entropy within 1e-6 of the full logits (fp32) at the scored
    positions, 0 elsewhere; the gradients of a loss on them equal (float64, where the summation
    order of fp32 would blur a real difference)."""
    from transformers import AutoModelForCausalLM

    batch = _padded_batch()
    positions = batch["attention_mask"][:, 1:].bool() & (torch.arange(6) >= 2)  # a completion-like subset
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(0)) * positions
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)
        logp, entropy = token_logprobs(model, batch, 0.8, with_entropy=True, positions=positions,
                                       chunk_elements=chunk_tokens * model.config.vocab_size,
                                       keep_bytes=keep_bytes)
        (logp * weights.to(logp.dtype)).sum().backward()
        chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        want, want_entropy = _full(model, batch, 0.8)
        (want * weights.to(want.dtype)).sum().backward()
        torch.testing.assert_close(logp, want * positions, atol=tol, rtol=0)
        torch.testing.assert_close(entropy, (want_entropy * positions).detach(), atol=tol, rtol=0)
        assert not entropy.requires_grad and bool((logp[~positions] == 0).all())
        if dtype == torch.float64:
            for name, p in model.named_parameters():
                torch.testing.assert_close(chunked_grads[name], p.grad, atol=1e-12, rtol=0, msg=name)


def test_default_positions_are_the_real_next_tokens_and_the_lora_reference_matches(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlkit.learner.logprobs import Reference

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = _padded_batch()
    with torch.no_grad():
        want, _ = _full(base, batch)
        reals = batch["attention_mask"][:, 1:].bool()
        logp, _ = token_logprobs(base, batch)
        torch.testing.assert_close(logp, want * reals, atol=1e-6, rtol=0)
        peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        adapted, _ = token_logprobs(peft, batch)
        assert (adapted - want * reals).abs().max() > 1e-4  # the adapter is in the path
        torch.testing.assert_close(Reference(peft, "lora", None).logprobs(batch), want * reals, atol=1e-6, rtol=0)


def test_packed_micro_batches_score_as_the_padded_ones(tiny_model):
    """Padding-free rows (GRPOBatch.packed_micro_batch): logprobs and entropy at the completion
    tokens equal the padded micro-batch's within 1e-6 (fp32), the GRPO loss too, and the gradients
    agree (fp64)."""
    from transformers import AutoModelForCausalLM

    from rlkit.grpo.batch import GRPOBatch, Rollout
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.rollout.config import RolloutConfig

    rs = [Rollout([5, 17, 99], [230, 41, 7, 8], False), Rollout([5, 6], [7, 9], False),
          Rollout([11, 12, 13, 14, 15], [16], False)]
    b = GRPOBatch.collate(rs, torch.tensor([1.0, -0.5, 0.3]), pad_id=0)
    padded, packed = b.micro_batch([0, 1, 2]), b.packed_micro_batch([0, 1, 2])
    norm = torch.tensor(7.0, dtype=torch.float64)
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.9))
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)
        grads, results = [], []
        for mb in (padded, packed):
            positions = objective.positions(mb)
            logp, entropy = token_logprobs(model, mb, 0.9, with_entropy=True, positions=positions)
            loss, _ = objective(model, {**mb, "num_items_in_batch": norm})
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
            results.append((logp.detach(), entropy, loss.detach()))
        assert_packed_as_padded(results, grads, dtype, tol)


def test_a_model_that_changes_its_logits_after_the_lm_head_takes_the_full_path(caplog):
    """Gemma 2 soft-caps its logits: the first call finds lm_head(h) != logits and says so once."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=0.5)).eval()
    batch = {"input_ids": torch.tensor([[1, 5, 9, 3, 7]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    with torch.no_grad(), caplog.at_level("WARNING"):
        first, _ = token_logprobs(model, batch)
        second, _ = token_logprobs(model, batch)
        want, _ = _full(model, batch)
    torch.testing.assert_close(first, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(second, want, atol=1e-6, rtol=0)
    assert sum("changes its logits after the lm_head" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs (Linux)")
def test_a_training_step_on_a_32k_vocabulary_does_not_hold_the_logits(tmp_path):
    """Peak resident memory of one forward + backward of the token logprobs (32768-token vocabulary,
    4 x 512 tokens: fp32 logits of 256 MiB), each path in its own process (glibc returns every
    block over 64 KiB at once, so the peak follows the live tensors): the step that keeps the
    probabilities for its backward (they fit its budget) peaks lower than the full logits by more
    than their own size; the step whose budget is smaller projects each chunk again and peaks
    below one copy of them; same logprobs."""
    import subprocess
    import sys

    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    peaks = {}
    for mode in ("full", "kept", "chunked"):
        out = subprocess.run([sys.executable, str(script), mode, str(tmp_path / f"{mode}.pt")], capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
        assert out.returncode == 0, out.stderr[-3000:]
        peaks[mode] = float(out.stdout.split()[-1])
    logits = 4 * 511 * 32768 * 4
    for mode in ("kept", "chunked"):
        torch.testing.assert_close(torch.load(tmp_path / f"{mode}.pt"), torch.load(tmp_path / "full.pt"), atol=1e-6,
                                   rtol=0)
    shown = {k: v / 2**20 for k, v in peaks.items()}
    assert peaks["full"] - peaks["kept"] >= logits, shown
    assert peaks["chunked"] < logits < peaks["kept"], shown


PEAK_SCRIPT = '''
import gc, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from rlkit.learner import logprobs as lp

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
ids = torch.randint(0, 32768, (4, 512))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

def step():
    if sys.argv[1] == "full":
        logp = lp.selective_log_softmax(model(**batch).logits[:, :-1].float(), ids[:, 1:])
    else:
        keep = 2**29 if sys.argv[1] == "kept" else 2**20
        logp, _ = lp.token_logprobs(model, batch, with_entropy=True, chunk_elements=2**22, keep_bytes=keep)
    logp.sum().backward()
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: not part of the difference
    return logp.detach()

step()  # first touch of the gradients, the allocator, the check of the model's logits
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from now
before = rss("VmRSS")
torch.save(step(), sys.argv[2])
print(rss("VmHWM") - before)
'''
