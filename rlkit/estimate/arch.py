"""What memory depends on in a decoder-only model: its config.json, read without the weights (a local
folder, rlkit's copy of the shipped recipes' hub models, the hub, or a tiny size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import UserError, read_json

GATED = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral",
         "deepseek_v2", "deepseek_v3", "phi3", "internlm2", "baichuan", "yi", "olmo2", "granite"}


# a language model's family above, by a model_type its config may give it: a vision-language model's
# (its text_config's), or a text-only Gemma 3's (the 270M is saved as gemma3_text)
TEXT_FAMILY = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
               "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "gemma3_text": "gemma3"}

# the block linears of the families `Arch` reads, by their module names (LoRA's targets)
BLOCK_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2"}
# config.json of the hub models the shipped recipes name (from their published config.json), for
# a host without a hub: the fields the estimate reads.
PUBLISHED = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                                    num_hidden_layers=28, num_attention_heads=28,
                                                    num_key_value_heads=4, vocab_size=152064,
                                                    tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B-Instruct": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648,
                                      num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                      vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                       vocab_size=151936, tie_word_embeddings=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                                      num_hidden_layers=28, num_attention_heads=12,
                                                      num_key_value_heads=2, vocab_size=151936,
                                                      tie_word_embeddings=False),
    "meta-llama/Llama-2-7b-hf": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                     vocab_size=32000, tie_word_embeddings=False),
    "Qwen/Qwen2.5-VL-7B-Instruct": dict(
        model_type="qwen2_5_vl", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
        max_position_embeddings=128000, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        vision_config=dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
                           in_chans=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, temporal_patch_size=2)),
    "facebook/opt-6.7b": dict(model_type="opt", hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                              num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048,
                              tie_word_embeddings=True, enable_bias=True),
}



@dataclass(frozen=True)
class Arch:
    """What memory depends on in a decoder-only model's config.json."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    gated: bool  # SwiGLU MLP (gate, up, down) rather than fc1, fc2
    bias: bool  # q/k/v (Qwen2) or every linear layer (OPT) has a bias
    positions: int = 0  # learned position embeddings (OPT, GPT-2)
    experts: int = 1  # MoE: MLPs per layer
    attn_out: str = "o_proj"  # the attention output projection's module name (OPT: out_proj)
    vision: VisionSide | None = None  # a vision-language model's vision tower and projector

    @classmethod
    def from_config(cls, c: dict[str, Any], name: str) -> Arch:
        """The decoder of `c`; for a vision-language model (a `vision_config`) its language model,
        with its vision side counted (`VisionSide`)."""
        if c.get("vision_config"):
            from dataclasses import replace

            text = {**c, **(c.get("text_config") or {})}
            text.pop("vision_config", None)
            return replace(cls.from_config(text, name), vision=VisionSide.from_config(c, name))
        return cls._decoder(c, name)

    @classmethod
    def _decoder(cls, c: dict[str, Any], name: str) -> Arch:
        def first(*keys: str, default: Any = None) -> Any:
            return next((c[k] for k in keys if c.get(k) is not None), default)

        hidden = first("hidden_size", "n_embd", "d_model")
        layers = first("num_hidden_layers", "n_layer", "num_layers")
        heads = first("num_attention_heads", "n_head")
        if not (hidden and layers and heads and c.get("vocab_size")):
            raise UserError(f"{name}: config.json has no hidden_size / num_hidden_layers / num_attention_heads / "
                            "vocab_size: rlkit estimate reads decoder-only models")
        kind = TEXT_FAMILY.get(c.get("model_type", ""), c.get("model_type", ""))
        return cls(name=name, layers=layers, hidden=hidden, heads=heads,
                   intermediate=first("moe_intermediate_size", "intermediate_size", "ffn_dim", "n_inner",
                                      default=4 * hidden),
                   kv_heads=first("num_key_value_heads", default=heads), head_dim=first("head_dim",
                                                                                       default=hidden // heads),
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", kind != "llama")),
                   gated=kind in GATED, bias=kind in ("qwen2", "opt") or bool(c.get("enable_bias")),
                   positions=c.get("max_position_embeddings", 0) + 2 if kind == "opt" else 0,
                   experts=first("num_experts", "num_local_experts", "n_routed_experts", default=1),
                   attn_out="out_proj" if kind == "opt" else "o_proj")

    def linears(self) -> dict[str, tuple[int, int]]:
        """The linear layers of one block, (in, out) features, by the module names LoRA targets."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                self.attn_out: (q, self.hidden)}
        if self.gated:
            return {**attn, "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                    "down_proj": (self.intermediate, self.hidden)}
        return {**attn, "fc1": (self.hidden, self.intermediate), "fc2": (self.intermediate, self.hidden)}

    def layer_params(self) -> int:
        mlp = {"gate_proj", "up_proj", "down_proj", "fc1", "fc2"}
        total = sum(i * o * (self.experts if name in mlp else 1) for name, (i, o) in self.linears().items())
        if self.bias:  # OPT: every linear layer; Qwen2: q, k, v
            total += sum(o for name, (_, o) in self.linears().items()
                         if self.positions or name in ("q_proj", "k_proj", "v_proj"))
        if self.experts > 1:
            total += self.hidden * self.experts  # the router
        return total + 2 * self.hidden * (2 if self.positions else 1)  # norms (OPT's LayerNorm has a bias)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden

    @property
    def language_params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params + self.hidden

    @property
    def params(self) -> int:
        """Every parameter: the language model's, and a vision-language model's vision side."""
        return self.language_params + (self.vision.params if self.vision else 0)

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """LoRA's parameters on the block linears `targets` names; a block linear of another family
        (OPT's model has no o_proj, llama's no fc1) is the recipe's error, as `model.checks.check_lora_targets`
        says at launch, not a module to count."""
        shapes = self.linears()
        if "all-linear" in targets:
            targets = tuple(shapes)
        foreign = [t for t in targets if t in BLOCK_LINEARS and t not in shapes]
        if foreign:
            raise UserError(f"lora.target_modules: {', '.join(foreign)} not in {self.name} (its block's linear "
                            f"layers: {', '.join(shapes)}): name those")
        return self.layers * sum(r * (i + o) for name, (i, o) in shapes.items() if name in targets)

    @property
    def largest_module_params(self) -> int:
        """The parameters of the largest single module (ZeRO-3 gathers a module at a time): the
        embedding (or lm_head) in a language model, else the widest MLP projection."""
        return max(self.vocab * self.hidden, *(i * o for i, o in self.linears().values()))

    def kv_bytes_per_token(self, width: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * width

    def activation_elements(self) -> int:
        """Elements one block keeps per token for backward (sdpa / flash attention)."""
        mlp = 4 * self.intermediate if self.gated else 2 * self.intermediate
        return 10 * self.hidden + 2 * self.kv_heads * self.head_dim + mlp


@dataclass(frozen=True)
class VisionSide:
    """A vision-language model's vision tower and projector: their parameters (counted on a model
    built on the meta device from the config: no weights, any architecture transformers has) and
    the image tokens one image becomes where the config fixes it (Idefics3/SmolVLM, LLaVA; 0 where
    it depends on the image's size, as Qwen2-VL's)."""

    tower: int
    projector: int
    tokens_per_image: int = 0

    @property
    def params(self) -> int:
        return self.tower + self.projector

    @classmethod
    def from_config(cls, c: dict[str, Any], name: str) -> VisionSide:
        import torch
        from transformers import AutoConfig

        from rlkit.model.vision import auto_class, vision_parts

        try:
            config = AutoConfig.for_model(**c)
            with torch.device("meta"):
                model = auto_class(config).from_config(config)
        except Exception as e:  # noqa: BLE001 - an architecture this transformers lacks: one line
            raise UserError(f"{name}: transformers cannot build this vision-language model from its config.json "
                            f"({type(e).__name__}: {str(e)[:160]}): rlkit estimate counts its vision tower on "
                            "it") from None
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        parts = vision_parts(model)
        v = c["vision_config"]
        tokens = c.get("mm_tokens_per_image") or 0  # Gemma 3 says it; Qwen2-VL's depends on each image
        if not tokens and v.get("image_size") and v.get("patch_size"):  # a fixed-size tower (LLaVA, Idefics3)
            tokens = (v["image_size"] // v["patch_size"]) ** 2 // c.get("scale_factor", 1) ** 2
        return cls(sum(sizes[n] for n in parts["vision"]), sum(sizes[n] for n in parts["projector"]), tokens)


def config_json(path: str, config: str | None = None) -> tuple[dict[str, Any], str]:
    """config.json of `path` (a folder or a hub id), or of `config` (a config.json, a folder, a
    hub id, a tiny size: the model a placeholder path stands for), and where it came from. A
    folder's is read once (`model.facts.config_file`)."""
    from rlkit.model.facts import config_file

    if config:
        if Path(config).is_file():
            return _read_json(Path(config)), config
        return config_json(config)
    local = config_file(path)
    if local is not None:
        return local, str(Path(path) / "config.json")
    tiny = _tiny_config(path)
    if tiny:
        return tiny
    if path in PUBLISHED:
        return dict(PUBLISHED[path]), "its published config.json, kept in rlkit"
    try:
        from huggingface_hub import hf_hub_download

        return _read_json(Path(hf_hub_download(path, "config.json"))), "config.json from the hub"
    except Exception as e:  # noqa: BLE001 - offline, missing, gated: one line
        raise UserError(f"model.path: {path} has no config.json here and the hub did not give one "
                        f"({type(e).__name__}): pass --config with the model's config.json, its folder or its hub "
                        "id (for a run's output, the model it started from)") from None


def _tiny_config(path: str) -> tuple[dict[str, Any], str] | None:
    from rlkit.tiny import SIZES

    name = Path(path).name
    for size, s in SIZES.items():
        if name in (size, f"tiny-{size}") or path == size:
            return dict(model_type="qwen2", hidden_size=s.hidden, intermediate_size=s.intermediate,
                        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                        vocab_size=s.vocab, tie_word_embeddings=s.tie_embeddings), f"rlkit's {size} model's config"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, dict, "a model's config.json (a JSON object)")
