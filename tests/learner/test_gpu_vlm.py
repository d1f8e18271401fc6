"""A vision-language model's learner on a CUDA device, without Ray or vLLM (skipped without CUDA or
DeepSpeed): the tiny Idefics3 in bf16 at ZeRO 0 and 3, on a fixed batch of the shape-colour task
as the SFT run collates it (the processor's image tokens, the pixels under `image.*`).

What only a device shows: the pixels cast to the model's bf16 on the way in, the vision tower
trained (or kept byte for byte when frozen) and gathered under ZeRO-3, and the learner's bf16
logprobs with the image, through the same path as the parity probe, against an fp32 transformers
forward of the learner's own weights. (vLLM, which serves Qwen2-VL and LLaVA on GPU hosts, is not
on the lent device machine: the engine side of those stays a GPU host's check.)

Run with gloo and bf16 on a CPU with AVX512-BF16 in place of the device (the same body): NLL 6.19 ->
2.39 (ZeRO-0), logprobs vs fp32 max 0.0096 / mean 0.0025 nats over 369 tokens at ZeRO-0 and -3.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.sides import CUDA_LEARNER_MARKS

pytestmark = CUDA_LEARNER_MARKS
TRAINED = {"freeze_vision_tower": False, "freeze_multi_modal_projector": False}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict:
    """The tiny VLM, its processor, and one micro-batch of 8 SFT rows of the shape-colour task."""
    from rlkit.config import ModelConfig
    from rlkit.model.load import load_image_inputs, load_tokenizer
    from rlkit.sft.config import SFTDataConfig
    from rlkit.sft.run import load_sft_data, micro_batches
    from rlkit.tiny_vlm import build_tiny_vlm, write_shape_task

    root = tmp_path_factory.mktemp("gpu-vlm")
    model_dir = build_tiny_vlm(root / "model")
    task = write_shape_task(root / "data", n_train=8, n_eval=2)
    tokenizer = load_tokenizer(ModelConfig(path=str(model_dir)))
    images = load_image_inputs(ModelConfig(path=str(model_dir)), tokenizer)
    data = load_sft_data(SFTDataConfig(train=str(task["sft_train"]), template="chat", cutoff_len=128), tokenizer,
                         0, images)
    batch, = micro_batches(data.train, 8, False, data.pad_id, images)
    return {"model": model_dir, "images": images, "rows": data.train, "batch": batch}


def _parts(learner) -> dict[str, dict[str, torch.Tensor]]:
    """The learner's weights (gathered) by part: language, vision, projector."""
    from rlkit.model.vision import vision_parts

    weights = dict(learner.named_weights())
    names = vision_parts(learner.engine.module)
    return {part: {n: weights[n].detach().clone() for n in ns if n in weights} for part, ns in names.items()}


@pytest.mark.parametrize("zero, model", [(0, TRAINED), (3, TRAINED), (3, {})], ids=["zero0", "zero3", "zero3-frozen"])
def test_a_bf16_vlm_learner_trains_on_pictures_and_scores_them_like_fp32(learners, shapes, zero, model):
    from transformers import AutoModelForImageTextToText
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from rlkit.learner.logprobs import token_logprobs
    from rlkit.sft.objective import NLLObjective

    learner, summary = learners(shapes["model"], zero, micro=8, model=model)
    assert summary["precision"] == "bf16" and summary["device"] == "cuda"
    batch = shapes["batch"]
    assert batch["image.pixel_values"].dtype == torch.float32  # the processor's; the learner casts them
    before = _parts(learner)
    losses = []
    for _ in range(10):
        m = learner.train_step([batch], NLLObjective())
        losses.append(m.sums["nll"] / m.sums["tokens"])
    after = _parts(learner)
    print(f"\nZeRO-{zero} VLM bf16 SFT NLL per step ({'vision trained' if model else 'vision frozen'}): "
          + " ".join(f"{x:.3f}" for x in losses))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], losses
    moved = {part: any(not torch.equal(before[part][n], after[part][n]) for n in before[part]) for part in before}
    assert moved == {"language": True, "vision": bool(model), "projector": bool(model)}, moved

    got = learner.logprobs([batch])[0]
    ids = batch["input_ids"]
    probe = learner.sequence_logprobs([r["input_ids"] for r in shapes["rows"][:2]],
                                      shapes["images"].pixels([r["images"] for r in shapes["rows"][:2]]))
    for row, lp in enumerate(probe):  # the parity probe's path: the same rows score the same, up to the
        # bf16 rounding of kernels chosen for another batch shape (on this test's CPU stand-in: within 1e-5)
        torch.testing.assert_close(torch.tensor(lp), got[row, :len(lp)], atol=0.05, rtol=0)
    unset_hf_deepspeed_config()  # ZeRO-3's HF config would make the reference load partitioned too
    reference = AutoModelForImageTextToText.from_pretrained(shapes["model"], dtype=torch.float32).eval()
    weights = {n: t.float() for part in after.values() for n, t in part.items()}
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and not [n for n in missing if "lm_head" not in n], (missing, unexpected)
    with torch.no_grad():
        want = token_logprobs(reference, dict(batch))[0]
    keep = batch["attention_mask"][:, 1:].bool() & (ids[:, 1:] != shapes["images"].token_id)
    diff = (got - want)[keep].abs()
    print(f"ZeRO-{zero} VLM bf16 learner logprobs vs fp32 HF (with the pixels): max abs diff {diff.max():.4f}, "
          f"mean {diff.mean():.4f} over {int(keep.sum())} tokens")
    assert diff.mean() < 0.02 and diff.max() < 0.15, (float(diff.mean()), float(diff.max()))
