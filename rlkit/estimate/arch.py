"""What memory depends on in a decoder-only model: its config.json, read without the weights (a local
folder, rlkit's copy of the shipped recipes' hub models, the hub, or a tiny size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import UserError, read_json

GATED = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral",
         "deepseek_v2", "deepseek_v3", "phi3", "internlm2", "baichuan", "yi", "olmo2", "granite"}


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

    @classmethod
    def from_config(cls, c: dict[str, Any], name: str) -> Arch:
        def first(*keys: str, default: Any = None) -> Any:
            return next((c[k] for k in keys if c.get(k) is not None), default)

        hidden = first("hidden_size", "n_embd", "d_model")
        layers = first("num_hidden_layers", "n_layer", "num_layers")
        heads = first("num_attention_heads", "n_head")
        if not (hidden and layers and heads and c.get("vocab_size")):
            raise UserError(f"{name}: config.json has no hidden_size / num_hidden_layers / num_attention_heads / "
                            "vocab_size: rlkit estimate reads decoder-only models")
        kind = c.get("model_type", "")
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
    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params + self.hidden

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """LoRA's parameters on the block linears `targets` names; a block linear of another family
        (OPT's model has no o_proj, llama's no fc1) is the recipe's error, as `models.check_lora_targets`
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


def model_config(path: str, config: str | None = None) -> tuple[dict[str, Any], str]:
    """config.json of `path` (a folder or a hub id), or of `config` (a config.json, a folder, a
    hub id, a tiny size: the model a placeholder path stands for), and where it came from."""
    if config:
        if Path(config).is_file():
            return _read_json(Path(config)), config
        return model_config(config)
    local = Path(path) / "config.json"
    if local.is_file():
        return _read_json(local), str(local)
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
