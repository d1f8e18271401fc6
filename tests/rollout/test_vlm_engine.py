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

    from rlkit.rollout.worker import RolloutWorker

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


def test_a_weight_sync_reaches_the_image_embeddings_of_an_image_the_engine_has_seen(tmp_path):
    """After a sync that changes the vision tower, an image the engine has already embedded is
    embedded again with the new weights: the sync resets vLLM's encoder cache with its prefix cache
    (without it the engine reuses the old embeddings, or fails the request with an encoder-cache
    miss and spins). The parity probe scores prompts with their images: it sees an engine whose
    vision tower is not the learner's, which the same prompt's text alone does not show."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlkit.data.images import ImageInputs
    from rlkit.grpo.parity import Probe
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.learner.objective import MicroBatch
    from rlkit.rollout.worker import RolloutWorker

    vlm = build_tiny_vlm(tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(vlm)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True)
    image = draw_shape(random.Random(3))[0]
    worker = RolloutWorker(str(vlm), dtype="float32", max_model_len=128, kv_cache_gib=1)

    def engine_logprobs() -> tuple[list[int], torch.Tensor]:
        out = worker.generate([{"prompt": text, "multi_modal_data": {"image": [image]}}], temperature=1.0,
                              max_tokens=4, seed=0)[0]
        return out.token_ids, torch.tensor(out.logprobs)

    first_ids, first = engine_logprobs()
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    torch.manual_seed(1)
    changed = {n: p.detach() + 0.5 * torch.randn_like(p) for n, p in model.named_parameters()
               if ".vision_model." in n or ".connector." in n}
    model.load_state_dict(changed, strict=False)
    inputs = ImageInputs(processor)
    seen = [inputs.encode(text, [image])]
    probe = Probe(seen, [{"prompt": text, "multi_modal_data": {"image": [image]}}],
                  inputs.pixels([[image]], MicroBatch.padded(seen)["input_ids"]))
    text_only = [[t for t in seen[0] if t != inputs.token_id]]

    def probe_gap(sequences: list[list[int]], prompts: list, pixels: dict) -> float:
        with torch.no_grad():
            learner = token_logprobs(model, MicroBatch.padded(sequences, pixels))[0][0]
        return float((torch.tensor(worker.sequence_logprobs(prompts)[0]) - learner).abs().max())

    assert probe_gap(text_only, text_only, {}) < 1e-4                   # the text alone: no gap to see
    assert probe_gap(probe.sequences, probe.engine_prompts, probe.pixels) > 1e-2  # the image: the old tower
    worker.update_weights(list(changed.items()))
    assert probe_gap(probe.sequences, probe.engine_prompts, probe.pixels) < 1e-4
    ids, after = engine_logprobs()
    enc = processor(text=[text], images=[[image]], return_tensors="pt")
    full = torch.cat([enc["input_ids"], torch.tensor([ids])], 1)
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=enc["pixel_values"],
                       pixel_attention_mask=enc["pixel_attention_mask"]).logits[0].float()
    start = enc["input_ids"].shape[1] - 1
    learner = torch.log_softmax(logits[start:start + len(ids)], -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert (after - learner).abs().max() < 1e-4, (after, learner)       # the new vision tower's embeddings
    assert first_ids != ids or (first - after).abs().max() > 1e-3  # and they are not the old ones


def test_a_sync_of_tied_embeddings_reaches_the_lm_head_of_a_vision_language_model(tmp_path):
    """A VLM says it ties its lm_head to the embeddings in its text config (and vLLM may keep the
    head under the language model): a sync of new embeddings must reach the CPU engine's packed
    copy of the head, or its logprobs drift from the learner's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlkit.rollout.worker import RolloutWorker

    vlm = build_tiny_vlm(tmp_path / "vlm", tied=True)
    processor = AutoProcessor.from_pretrained(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True)
    image = draw_shape(random.Random(5))[0]
    worker = RolloutWorker(str(vlm), dtype="float32", max_model_len=128, kv_cache_gib=1)
    torch.manual_seed(2)
    name, embeddings = next((n, p) for n, p in model.named_parameters() if "embed_tokens" in n)
    with torch.no_grad():
        embeddings.add_(0.5 * torch.randn_like(embeddings))
    worker.update_weights([(name, embeddings.detach().clone())])
    out = worker.generate([{"prompt": text, "multi_modal_data": {"image": [image]}}], max_tokens=4, seed=0)[0]
    enc = processor(text=[text], images=[[image]], return_tensors="pt")
    full = torch.cat([enc["input_ids"], torch.tensor([out.token_ids])], 1)
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=enc["pixel_values"],
                       pixel_attention_mask=enc["pixel_attention_mask"]).logits[0].float()
    start = enc["input_ids"].shape[1] - 1
    learner = torch.log_softmax(logits[start:start + len(out.token_ids)], -1).gather(
        -1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (torch.tensor(out.logprobs) - learner).abs().max() < 1e-4, (out.logprobs, learner)
