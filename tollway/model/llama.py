"""The Llama family by config: Llama 3, Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (QK-norm).
Pre-norm blocks, SiLU-gated MLP, plain RMSNorm."""
from __future__ import annotations

import torch

from tollway.model.decoder import DecoderModel
from tollway.model.embedding import Embedding
from tollway.model.layers import MLP, Attention, LinearBuilder, Rotary, norm_weight
from tollway.model.row_ops import TorchRowOps


class LlamaLayer:
    def __init__(self, t, build, i, cfg, rotary, ops: TorchRowOps, device):
        p = f"model.layers.{i}"
        self.ops = ops
        self.attn = Attention(t, build, f"{p}.self_attn", cfg, cfg.layer_types[i], rotary, ops, device)
        self.mlp = MLP(t, build, f"{p}.mlp", cfg.hidden_act, ops)
        self.input_norm = norm_weight(t[f"{p}.input_layernorm.weight"], 0.0, device)
        self.post_norm = norm_weight(t[f"{p}.post_attention_layernorm.weight"], 0.0, device)
        self.norms = (self.input_norm, None, self.post_norm, None)  # pre-norm: no norms after attention or MLP
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, positions, cache, meta, kernel):
        """x is updated in place and returned."""
        ops, eps = self.ops, self.eps
        normed = ops.add_rms_norm(x, self.attn(ops.rms_norm(x, self.input_norm, eps), positions, cache, meta, kernel),
                                  None, self.post_norm, eps)
        ops.add_rms_norm(x, self.mlp(normed, kernel), None, None, eps)
        return x


class LlamaModel(DecoderModel):
    def __init__(self, cfg, tensors: dict[str, torch.Tensor], build: LinearBuilder, max_positions: int,
                 ops: TorchRowOps, device):
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling, device)
        self.ops = ops
        self.layers = [LlamaLayer(tensors, build, i, cfg, rotary, ops, device) for i in range(cfg.num_layers)]
        self.embed = Embedding(tensors["model.embed_tokens.weight"], None, device, build.q8)
        self.final_norm = norm_weight(tensors["model.norm.weight"], 0.0, device)
        self.eps = cfg.rms_norm_eps
        self.lm_head = build.head("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head")
