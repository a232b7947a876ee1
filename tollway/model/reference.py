"""transformers' own implementation on the very tensors tollway loaded: the yardstick that
tests (greedy and logits match) and benchmarks (speed ratio) measure tollway against."""
from __future__ import annotations

import torch

from tollway.model.weights import LoadedModel


def transformers_gemma3(loaded: LoadedModel, attn_implementation: str = "eager", dtype=torch.float32):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = loaded.config
    if c.architecture != "gemma3":
        raise ValueError(f"expected a gemma3 model, got {c.architecture}")
    config = Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, sliding_window=c.sliding_window,
        layer_types=[f"{t}_attention" for t in c.layer_types], query_pre_attn_scalar=int(c.query_pre_attn_scalar),
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        attn_implementation=attn_implementation, dtype=torch.float32,
    )
    model = Gemma3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(loaded.float_tensors(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit transformers' Gemma 3: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype)
