"""The Llama family by config: Llama 3, Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (QK-norm).
Pre-norm blocks, SiLU-gated MLP, plain RMSNorm."""
from __future__ import annotations

import torch

from tollway.model.decoder import DecoderModel
from tollway.model.layers import MLP, Attention, AttentionMetadata, KVCache, LinearBuilder, Rotary, norm_weight, rms_norm


class LlamaLayer:
    def __init__(self, t, build, i, cfg, rotary, device):
        p = f"model.layers.{i}"
        self.attn = Attention(t, build, f"{p}.self_attn", cfg, cfg.layer_types[i], rotary, device)
        self.mlp = MLP(t, build, f"{p}.mlp", cfg.hidden_act)
        self.input_norm = norm_weight(t[f"{p}.input_layernorm.weight"], 0.0, device)
        self.post_norm = norm_weight(t[f"{p}.post_attention_layernorm.weight"], 0.0, device)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, positions, cache, meta, kernel):
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), positions, cache, meta, kernel)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps), kernel)


class LlamaModel(DecoderModel):
    def __init__(self, cfg, tensors: dict[str, torch.Tensor], build: LinearBuilder, max_positions: int, device):
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling, device)
        self.layers = [LlamaLayer(tensors, build, i, cfg, rotary, device) for i in range(cfg.num_layers)]
        self.embed = tensors["model.embed_tokens.weight"].float().to(device)
        self.final_norm = norm_weight(tensors["model.norm.weight"], 0.0, device)
        self.eps = cfg.rms_norm_eps
        self.lm_head = build("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head")

    def forward(self, input_ids, positions, caches: list[KVCache], meta: AttentionMetadata, kernel: str):
        x = self.embed[input_ids]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, positions, cache, meta, kernel)
        return rms_norm(x, self.final_norm, self.eps)
