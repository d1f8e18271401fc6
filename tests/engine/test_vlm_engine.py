"""vLLM's CPU build serves the tiny vision-language model as transformers scores it: a prompt with
one `<image>` placeholder per image and the picture in `multi_modal_data` is expanded once, to
the processor's tokens (sending the processor's already expanded ids would expand them again),
and the logprobs of the sampled tokens match transformers' on the same pixels."""

from __future__ import annotations

import random

import pytest
import torch

from rlkit.tiny_vlm import QUESTION, build_tiny_vlm, draw_shape

pytestmark = pytest.mark.slow


def test_vllm_serves_the_tiny_vlm_as_transformers_scores_it(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import SamplingParams

    from rlkit.engine.rollout import RolloutWorker

    vlm = build_tiny_vlm(tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(vlm)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True)
    images = [draw_shape(random.Random(seed))[0] for seed in (0, 1)]
    worker = RolloutWorker(str(vlm), dtype="float32", max_model_len=128, kv_cache_gib=1,
                           llm_kwargs={"limit_mm_per_prompt": {"image": 1}})
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=0, ignore_eos=True)
    outs = worker.llm.generate([{"prompt": text, "multi_modal_data": {"image": im}} for im in images], params,
                               use_tqdm=False)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    for image, out in zip(images, outs):
        enc = processor(text=[text], images=[[image]], return_tensors="pt")
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()  # expanded once, as the processor does
        sampled = list(out.outputs[0].token_ids)
        engine = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, sampled)])
        ids = torch.cat([enc["input_ids"], torch.tensor([sampled])], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=enc["pixel_values"],
                           pixel_attention_mask=enc.get("pixel_attention_mask")).logits[0].float()
        start = enc["input_ids"].shape[1] - 1
        learner = torch.log_softmax(logits[start:start + len(sampled)], -1).gather(
            -1, torch.tensor(sampled)[:, None])[:, 0]
        assert (engine - learner).abs().max() < 1e-4, (engine, learner)
