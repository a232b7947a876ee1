"""Gemma 3 (text): sandwich norms around attention and MLP, (1+w) RMSNorm, QK-norm,
scaled embeddings, tied LM head, and 5 sliding-window layers to every global one."""
from __future__ import annotations

import torch

from tollway.model.decoder import DecoderModel
from tollway.model.layers import MLP, Attention, AttentionMetadata, KVCache, LinearBuilder, Rotary, norm_weight, rms_norm


class Gemma3Layer:
    def __init__(self, t, build, i, cfg, rotary, device):
        p = f"model.layers.{i}"
        self.layer_type = cfg.layer_types[i]
        self.attn = Attention(t, build, f"{p}.self_attn", cfg, self.layer_type, rotary, device)
        self.mlp = MLP(t, build, f"{p}.mlp", cfg.hidden_act)
        self.norms = {n: norm_weight(t[f"{p}.{n}.weight"], 1.0, device) for n in
                      ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        self.eps = cfg.rms_norm_eps

    def _norm(self, x, name):
        return rms_norm(x, self.norms[name], self.eps)

    def __call__(self, x, positions, cache, meta, kernel):
        h = self.attn(self._norm(x, "input_layernorm"), positions, cache, meta, kernel)
        x = x + self._norm(h, "post_attention_layernorm")
        h = self.mlp(self._norm(x, "pre_feedforward_layernorm"), kernel)
        return x + self._norm(h, "post_feedforward_layernorm")


class Gemma3Model(DecoderModel):
    def __init__(self, cfg, tensors: dict[str, torch.Tensor], build: LinearBuilder, max_positions: int, device):
        rotary = {
            "full": Rotary(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling, device),
            "sliding": Rotary(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, max_positions, None, device),
        }
        self.layers = [Gemma3Layer(tensors, build, i, cfg, rotary[cfg.layer_types[i]], device)
                       for i in range(cfg.num_layers)]
        self.embed = tensors["model.embed_tokens.weight"].float().to(device)
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=torch.float32, device=device)
        self.final_norm = norm_weight(tensors["model.norm.weight"], 1.0, device)
        self.eps = cfg.rms_norm_eps
        self.lm_head = build("lm_head" if "lm_head.weight" in tensors else "model.embed_tokens")
        self.final_logit_softcapping = cfg.final_logit_softcapping

    def forward(self, input_ids, positions, caches: list[KVCache], meta: AttentionMetadata, kernel: str):
        x = self.embed[input_ids] * self.embed_scale
        for layer, cache in zip(self.layers, caches):
            x = layer(x, positions, cache, meta, kernel)
        return rms_norm(x, self.final_norm, self.eps)
