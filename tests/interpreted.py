"""Liger's kernels as rlkit applies them, run by Triton's interpreter on the CPU: the GPU learner's
code paths (the instance patching of `rlkit.model.kernels`, rlkit's head and objectives) on tiny
shapes, in CI. Each check runs in a process of its own, started by tests/model/test_kernels.py with
`TRITON_INTERPRET=1` (Triton reads it when a kernel is defined, at Liger's import: the variable
cannot be set for one test inside the suite's processes, where vLLM and Ray run too):

    TRITON_INTERPRET=1 python -m tests.interpreted CHECK MODEL_DIR

The interpreter has two gaps Liger's kernels fall into, filled here and never in what runs on a
GPU: it hands a kernel's float arguments over as Python floats, which have no `.to` (a GPU launch
makes them fp32 scalars), and it has no libdevice `rsqrt`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def _interpreter_shims() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    convert = interpreter._implicit_cvt

    def as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = as_fp32
    import liger_kernel.ops.rms_norm as rms_norm

    rms_norm.rsqrt = lambda x: 1.0 / tl.sqrt(x)


def _models(model_dir: Path, lora: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' modules, Liger's kernels applied by rlkit) on the same fp32 weights."""
    from transformers import AutoModelForCausalLM

    from rlkit.model.kernels import apply_kernels

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert apply_kernels(fused, "liger", "cuda")  # the learner's call, as on a GPU host
    if lora:
        from peft import LoraConfig, get_peft_model

        def wrap(model):
            torch.manual_seed(0)
            config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
            return get_peft_model(model, config)

        plain, fused = wrap(plain), wrap(fused)
    return plain, fused


def _close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> float:
    diff = (got - want).abs().max().item()
    assert diff <= bound, f"{what}: max abs diff {diff:.3g} > {bound}"
    return diff


def check_kernels(model_dir: Path) -> None:
    """Each kernel against transformers' module on the same input: RMSNorm, SwiGLU (outputs and input
    gradients) and the rotary embedding (an attention layer's output, through Liger's RoPE)."""
    plain, fused = _models(model_dir)
    torch.manual_seed(0)
    hidden = plain.config.hidden_size
    x = torch.randn(2, 12, hidden)
    for name, get in (("RMSNorm", lambda m: m.model.norm), ("SwiGLU", lambda m: m.model.layers[0].mlp)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = get(plain)(a), get(fused)(b)
        want.square().sum().backward()
        got.square().sum().backward()
        print(f"{name}: out {_close(got, want, 1e-5, name):.2g}, grad {_close(b.grad, a.grad, 1e-4, name):.2g}")
    positions = torch.arange(12)[None].expand(2, -1)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    outs = []
    for model, inp in ((plain, a), (fused, b)):
        rotary = model.model.rotary_emb(inp, positions)
        out, _ = model.model.layers[0].self_attn(inp, position_embeddings=rotary, attention_mask=None)
        out.square().sum().backward()
        outs.append(out)
    print(f"RoPE: out {_close(outs[1], outs[0], 1e-5, 'RoPE'):.2g}, grad {_close(b.grad, a.grad, 1e-4, 'RoPE'):.2g}")


def check_instance(model_dir: Path) -> None:
    """The kernels are in the one instance: transformers' module keeps its names, a model of the same
    family built afterwards runs transformers' code (its output equals the unpatched one's bit for bit,
    while the patched one's differs by rounding), and both the patched instance's modules and the
    unpatched ones are what they say."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2

    names = {n: getattr(modeling_qwen2, n) for n in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")}
    forwards = {c: c.forward for c in (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP,
                                       modeling_qwen2.Qwen2Attention, modeling_qwen2.Qwen2ForCausalLM)}
    plain, fused = _models(model_dir)
    after = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert {n: getattr(modeling_qwen2, n) for n in names} == names, "a transformers name was left swapped"
    assert {c: c.forward for c in forwards} == forwards, "a transformers class was left patched"
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    for layer in fused.model.layers:
        assert layer.mlp._get_name() == "LigerSwiGLUMLP" and layer.input_layernorm._get_name() == "LigerRMSNorm"
        assert layer.self_attn.forward.__func__.__globals__["apply_rotary_pos_emb"] is liger_rotary_pos_emb
    for model in (plain, after):
        assert not any("forward" in vars(m) for m in model.modules()), "an unpatched model has a bound forward"
        assert type(model.model.norm) is names["Qwen2RMSNorm"] and type(model.model.layers[0].mlp) is names["Qwen2MLP"]
    ids = torch.randint(4, plain.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, again = (m(input_ids=ids).logits for m in (plain, fused, after))
    assert torch.equal(again, want)
    print(f"patched vs plain logits: max abs diff {_close(got, want, 1e-4, 'logits'):.2g}; a later model: equal")


def check_step(model_dir: Path, lora: bool) -> None:
    """rlkit's head and objectives on the patched model against the unpatched one: the SFT NLL and
    the GRPO loss (temperature 0.7, entropy, clipped ratios), their logprobs, and every trained
    parameter's gradient."""
    from rlkit.grpo.config import GRPOAlgoConfig
    from rlkit.grpo.objective import GRPOObjective
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.rollout.config import RolloutConfig
    from rlkit.sft.objective import NLLObjective

    plain, fused = _models(model_dir, lora)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(4, plain.config.get_text_config().vocab_size, (4, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # a shorter row, padded
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :6] = -100
    completion = (labels != -100).long()
    sft = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    grpo = {"input_ids": ids, "attention_mask": mask, "completion_mask": completion,
            "advantages": torch.tensor([1.0, -0.5, 0.25, -0.75]),
            "old_logp": None, "num_items_in_batch": completion[:, 1:].sum().float()}
    objective = GRPOObjective.from_config(GRPOAlgoConfig(), RolloutConfig(temperature=0.7, max_tokens=18))
    with torch.no_grad():
        old, _ = token_logprobs(plain, grpo, 0.7, positions=objective.positions(grpo))
    grpo["old_logp"] = old + 0.05 * torch.randn(old.shape, generator=gen)  # ratios away from 1, some clipped
    for name, obj, batch in (("SFT", NLLObjective(), sft), ("GRPO", objective, grpo)):
        results = []
        for model in (plain, fused):
            model.zero_grad()
            loss, metrics = obj(model, batch)
            loss.backward()
            logp, entropy = token_logprobs(model, batch, 0.7, with_entropy=True, positions=obj.positions(batch))
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            results.append((loss.detach(), logp.detach(), entropy.detach(), grads))
        (loss0, logp0, ent0, g0), (loss1, logp1, ent1, g1) = results
        assert g0.keys() == g1.keys() and g0
        worst = max(((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp(min=1e-12)).item() for n in g0)
        assert worst <= 1e-3, f"{name}: a gradient differs by {worst:.3g} of its largest entry"
        print(f"{name}{' LoRA' if lora else ''}: loss {_close(loss1, loss0, 1e-5, 'loss'):.2g}, "
              f"logprobs {_close(logp1, logp0, 1e-5, 'logprobs'):.2g}, "
              f"entropy {_close(ent1, ent0, 1e-5, 'entropy'):.2g}, gradients {worst:.2g} of the largest")


CHECKS = {"kernels": check_kernels, "instance": check_instance, "step": lambda d: check_step(d, lora=False),
          "step-lora": lambda d: check_step(d, lora=True)}

if __name__ == "__main__":
    _interpreter_shims()
    CHECKS[sys.argv[1]](Path(sys.argv[2]))
