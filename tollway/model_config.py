"""ModelConfig: what the forward pass needs to know, read from an HF config.json or GGUF metadata.

No torch here: the scheduler side and the CLI may read a config without paying for torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tollway.gguf_file import GGUFFile

# HF model_type -> the architecture that runs it. llama.py covers the Llama-shaped family by flags.
_HF_ARCHITECTURES = {
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # the multimodal wrapper: only its text_config is used
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
}
# GGUF general.architecture -> the architecture that runs it (Mistral GGUFs say "llama").
_GGUF_ARCHITECTURES = {"gemma3": "gemma3", "llama": "llama", "qwen2": "llama", "qwen3": "llama"}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# Gemma3TextConfig defaults: multimodal Gemma 3 checkpoints leave these out of their text_config.
_GEMMA3_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture tollway cannot run."""


def _unsupported(name: str, supported: dict[str, str]) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported model architecture {name!r}; supported: {', '.join(sorted(supported))}"
    )


@dataclass
class ModelConfig:
    """Architecture hyperparameters in the Hugging Face conventions.

    Weights follow HF too: Gemma RMSNorm weights are stored as w and applied as (norm_offset + w).
    """

    architecture: str  # "gemma3" | "llama" (llama also runs Mistral, Qwen2/2.5, Qwen3)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # base of full-attention layers (of all layers outside gemma3)
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str  # "gelu_tanh" | "silu"
    layer_types: list[str]  # per layer: "full" | "sliding"
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # gemma3 sliding layers' rope base
    # HF-style dict with "rope_type" ("linear", "llama3", "yarn", ...), or
    # {"rope_type": "freq_factors", "factors": [...]}: llama.cpp's per-dimension divisors of the
    # inverse frequencies (Llama 3.x GGUFs). In gemma3 it applies to the full-attention layers only.
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3, Gemma3)
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    query_pre_attn_scalar: float | None = None  # gemma3: attention scale is this ** -0.5
    embed_scale: float = 1.0  # embeddings are multiplied by this (gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # RMSNorm applies (norm_offset + w): 1.0 for gemma
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """KV cache bytes one token takes over every layer: K and V, `itemsize` bytes a value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**data)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json; rope settings in either the rope_theta/rope_scaling
        spelling or transformers 5's rope_parameters."""
        model_type = cfg.get("model_type")
        if model_type not in _HF_ARCHITECTURES:
            raise _unsupported(str(model_type), _HF_ARCHITECTURES)
        if _HF_ARCHITECTURES[model_type] == "gemma3":
            return _gemma3_from_hf(cfg)
        return _llama_from_hf(cfg)

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> ModelConfig:
        """From a GGUF file's metadata; a few flags are read off which tensors the file has."""
        return _from_gguf(reader)


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json of a {cfg.get('model_type')} model has no {key!r}")
    return cfg[key]


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def _rope(params: dict[str, Any] | None, theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling dict or None) from one HF rope spec (either spelling)."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", theta))
    legacy_type = params.pop("type", None)  # pre-4.45 spelling of rope_type
    rope_type = params.pop("rope_type", None) or legacy_type
    if rope_type in (None, "default"):
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    top = cfg
    if cfg.get("model_type") == "gemma3":
        cfg = cfg.get("text_config") or {}
    cfg = {**_GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    num_layers = cfg["num_hidden_layers"]
    if "rope_parameters" in cfg:  # transformers 5: one spec per layer type
        rope = cfg["rope_parameters"]
        rope_theta, rope_scaling = _rope(rope.get("full_attention"), cfg["rope_theta"])
        rope_local_theta, _ = _rope(rope.get("sliding_attention"), cfg["rope_local_base_freq"])
    else:
        rope_theta, rope_scaling = _rope(cfg.get("rope_scaling"), cfg["rope_theta"])
        rope_local_theta = float(cfg["rope_local_base_freq"])
    if "layer_types" in cfg:
        layer_types = [_layer_type(t) for t in cfg["layer_types"]]
    else:
        pattern = cfg.get("_sliding_window_pattern", cfg["sliding_window_pattern"])
        layer_types = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    hidden_size = cfg["hidden_size"]
    return ModelConfig(
        architecture="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=rope_theta,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
        hidden_act=_activation(cfg["hidden_activation"]),
        layer_types=layer_types,
        sliding_window=cfg["sliding_window"],
        rope_local_theta=rope_local_theta,
        rope_scaling=rope_scaling,
        qk_norm=True,
        attention_bias=bool(cfg.get("attention_bias", False)),
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        embed_scale=math.sqrt(hidden_size),
        norm_offset=1.0,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
    )


def _layer_type(name: str) -> str:
    return "sliding" if name == "sliding_attention" else "full"


def _llama_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg["model_type"]
    if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
        raise UnsupportedModelError(f"unsupported {model_type} variant: attention_bias/mlp_bias layers are not implemented")
    hidden_size = _require(cfg, "hidden_size")
    num_heads = _require(cfg, "num_attention_heads")
    num_layers = _require(cfg, "num_hidden_layers")
    rope_theta, rope_scaling = _rope(cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg.get("rope_theta", 10_000.0))

    sliding_window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding_window = None  # Qwen configs carry a window they do not use
    if sliding_window is None:
        layer_types = ["full"] * num_layers
    elif "layer_types" in cfg:
        layer_types = [_layer_type(t) for t in cfg["layer_types"]]
    elif model_type in ("qwen2", "qwen3"):
        first_sliding = cfg.get("max_window_layers", num_layers)
        layer_types = ["sliding" if i >= first_sliding else "full" for i in range(num_layers)]
    else:
        layer_types = ["sliding"] * num_layers
    return ModelConfig(
        architecture="llama",
        vocab_size=_require(cfg, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=_require(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=_activation(cfg.get("hidden_act", "silu")),
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope_scaling=rope_scaling,
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
    )


def _from_gguf(reader: GGUFFile) -> ModelConfig:
    def field(key: str, default: Any = None) -> Any:
        return reader.metadata.get(key, default)

    gguf_arch = field("general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise _unsupported(str(gguf_arch), _GGUF_ARCHITECTURES)
    architecture = _GGUF_ARCHITECTURES[gguf_arch]
    tensors = {t.name: t for t in reader.tensors}

    def arch_field(key: str, default: Any = None) -> Any:
        return field(f"{gguf_arch}.{key}", default)

    hidden_size = int(arch_field("embedding_length"))
    num_heads = int(arch_field("attention.head_count"))
    num_layers = int(arch_field("block_count"))
    head_dim = int(arch_field("attention.key_length", hidden_size // num_heads))
    sliding_window = arch_field("attention.sliding_window")

    rope_scaling = None
    scaling_type = arch_field("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(arch_field("rope.scaling.factor", 1.0))}
        original = arch_field("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes Llama 3's rope scaling into per-dimension divisors instead of metadata
        factors = tensors["rope_freqs.weight"].data
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}

    if architecture == "gemma3":
        # llama.cpp hardcodes these for gemma3 rather than storing them: every 6th layer is global,
        # sliding layers use base 10000, and the 27B model (62 layers) scales queries by hidden/heads.
        layer_types = ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(num_layers)]
        extra = dict(
            rope_local_theta=float(arch_field("rope.freq_base_swa", 10_000.0)),
            query_pre_attn_scalar=float(hidden_size // num_heads if num_layers == 62 else head_dim),
            embed_scale=math.sqrt(hidden_size),
            norm_offset=1.0,
            qk_norm=True,
        )
        default_theta, hidden_act = 1_000_000.0, "gelu_tanh"
    else:
        layer_types = ["sliding" if sliding_window else "full"] * num_layers
        extra = dict(qk_norm="blk.0.attn_q_norm.weight" in tensors, attention_bias="blk.0.attn_q.bias" in tensors)
        default_theta, hidden_act = 10_000.0, "silu"

    return ModelConfig(
        architecture=architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # ggml lists dims fastest-first
        hidden_size=hidden_size,
        intermediate_size=int(arch_field("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(arch_field("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(arch_field("rope.freq_base", default_theta)),
        max_position_embeddings=int(arch_field("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        hidden_act=hidden_act,
        layer_types=layer_types,
        sliding_window=int(sliding_window) if sliding_window else None,
        rope_scaling=rope_scaling,
        final_logit_softcapping=arch_field("final_logit_softcapping"),
        attn_logit_softcapping=arch_field("attn_logit_softcapping"),
        **extra,
    )
