"""Gemma 3 (text): sandwich norms around attention and MLP, (1+w) RMSNorm, QK-norm,
scaled embeddings, tied LM head, and 5 sliding-window layers to every global one."""
from __future__ import annotations

import torch

from tollway.model.decoder import DecoderModel
from tollway.model.embedding import Embedding
from tollway.model.layers import MLP, Attention, LinearBuilder, Rotary, norm_weight
from tollway.model.row_ops import TorchRowOps


class Gemma3Layer:
    def __init__(self, t, build, i, cfg, rotary, ops: TorchRowOps, device):
        p = f"model.layers.{i}"
        self.layer_type = cfg.layer_types[i]
        self.ops = ops
        self.attn = Attention(t, build, f"{p}.self_attn", cfg, self.layer_type, rotary, ops, device)
        self.mlp = MLP(t, build, f"{p}.mlp", cfg.hidden_act, ops)
        norm = {n: norm_weight(t[f"{p}.{n}.weight"], 1.0, device) for n in
                ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        self.input_norm, self.post_attn_norm = norm["input_layernorm"], norm["post_attention_layernorm"]
        self.pre_ff_norm, self.post_ff_norm = norm["pre_feedforward_layernorm"], norm["post_feedforward_layernorm"]
        self.norms = (self.input_norm, self.post_attn_norm, self.pre_ff_norm, self.post_ff_norm)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, positions, cache, meta, kernel):
        """x is updated in place and returned."""
        ops, eps = self.ops, self.eps
        h = self.attn(ops.rms_norm(x, self.input_norm, eps), positions, cache, meta, kernel)
        normed = ops.add_rms_norm(x, h, self.post_attn_norm, self.pre_ff_norm, eps)
        ops.add_rms_norm(x, self.mlp(normed, kernel), self.post_ff_norm, None, eps)
        return x


class Gemma3Model(DecoderModel):
    def __init__(self, cfg, tensors: dict[str, torch.Tensor], build: LinearBuilder, max_positions: int,
                 ops: TorchRowOps, device):
        rotary = {
            "full": Rotary(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling, device),
            "sliding": Rotary(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, max_positions, None, device),
        }
        self.ops = ops
        self.layers = [Gemma3Layer(tensors, build, i, cfg, rotary[cfg.layer_types[i]], ops, device)
                       for i in range(cfg.num_layers)]
        self.embed = Embedding(tensors["model.embed_tokens.weight"], cfg.embed_scale, device, build.q8)
        self.final_norm = norm_weight(tensors["model.norm.weight"], 1.0, device)
        self.eps = cfg.rms_norm_eps
        self.lm_head = build.head("lm_head" if "lm_head.weight" in tensors else "model.embed_tokens")
        self.final_logit_softcapping = cfg.final_logit_softcapping
