"""Building blocks shared by the architectures: norms, rotary, kernel-selectable linear, paged attention, MLP.

The residual stream and all norms stay in float32; only the matmul inputs change
dtype with the step's kernel, so the kernel choice is a per-step decision.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tollway.model.host_memory import HugePageArena, huge_page_empty
from tollway.model.native.qmatmul import GGUF_KINDS
from tollway.model.weights import GGUFWeight
from tollway.scheduler.step_model import ROW_GROUP

if TYPE_CHECKING:
    from tollway.model.native.qmatmul import Q8Library
    from tollway.model.row_ops import TorchRowOps

_log = logging.getLogger(__name__)

# Keys are processed in blocks aligned to absolute position 0, and query rows are padded
# to a multiple of 8 (below that, the CPU GEMM picks other kernels). Every sum then runs in
# the same order whatever else shares the step, so batching and chunking never change a
# result bit: the padding only ever adds exact zeros.
ATTENTION_BLOCK = 128
_ROW_MULTIPLE = ROW_GROUP["fp32"]  # the step model counts fp32 rows in these groups



def norm_weight(weight: torch.Tensor, offset: float, device: torch.device) -> torch.Tensor:
    """The multiplier an RMSNorm applies: Gemma's (1 + w) (offset 1.0) or Llama's w, computed once."""
    return (weight.float() + offset if offset else weight.float()).to(device)


class Linear:
    """y = x @ W.T (+ b), with one weight copy per kernel this runner may pick.

    q8 is the native integer matmul (native/qmatmul.py) when `q8` (the library) is given: `native`,
    a GGUF weight packed at its own width, or else the weight packed as int8 blocks where
    in_features is a multiple of its block; otherwise that layer runs the fp32 matmul for it.
    `weight`: a tensor, or anything with its .shape and .float() (a GGUFWeight, Stacked), made
    float only where a copy needs it."""

    def __init__(self, weight, bias: torch.Tensor | None, kernels: set[str], device: torch.device,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None, q8: Q8Library | None = None,
                 arena: HugePageArena | None = None, native=None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias.float().to(device) if bias is not None else None
        values = functools.cache(weight.float)
        wants_native = "q8" in kernels and q8 is not None
        if wants_native and native is None:
            native = self._packed(q8, values(), arena)
        self.native = native if wants_native else None
        dense = "fp32" in kernels or ("q8" in kernels and self.native is None)
        self.fp32 = values().to(device) if dense else None
        self.bf16 = values().to(torch.bfloat16).to(device) if "bf16" in kernels else None
        self.int8 = self.int8_scales = None
        if "int8" in kernels:
            q, scales = int8 if int8 is not None else quantize_int8(values())
            self.int8, self.int8_scales = q.to(device), scales.to(device)

    def _packed(self, q8: Q8Library, w: torch.Tensor, arena: HugePageArena | None):
        try:
            return q8.pack(w, arena)
        except ValueError as exc:  # shapes or values the kernel does not cover
            _log.warning("q8: a %dx%d linear runs the fp32 matmul: %s", self.out_features, self.in_features, exc)
            return None

    def packed(self, kernel: str):
        """The native weight copy `kernel` runs on, or None."""
        return self.native if kernel == "q8" else None

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        native = self.packed(kernel)
        if native is not None:
            y = native(x)
        elif kernel in ("fp32", "q8"):
            y = _padded_rows(x, lambda rows: F.linear(rows, self.fp32))
        elif kernel == "bf16":
            y = F.linear(x.to(torch.bfloat16), self.bf16).float()
        else:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.int8, self.int8_scales).float()
        return y + self.bias if self.bias is not None else y


def _padded_rows(x: torch.Tensor, fn) -> torch.Tensor:
    # fp32 GEMM rows come out bit-identical only for row counts that are multiples of 8
    # (measured with MKL on this CPU), so pad to keep results independent of the batch.
    pad = -x.shape[0] % _ROW_MULTIPLE
    if not pad:
        return fn(x)
    return fn(torch.cat([x, x.new_zeros(pad, x.shape[1])]))[: x.shape[0]]


class LinearBuilder:
    """Makes Linear layers from named weights, concatenating several names into one matmul
    (q/k/v, gate/up). A GGUF's weights are packed from the file's blocks at their own width, parts
    of different types each in its own format (Q8Library.pack_parts); a type without a native
    format is dequantized and packed as int8 blocks (exact for Q4_0's values), with one log line. int8 copies are taken from `int8` when there
    and added to it when not, so the runner can keep them on disk: quantizing 270M weights takes
    seconds at every start."""

    def __init__(self, tensors: dict, kernels: set[str], device: torch.device,
                 int8: dict[str, torch.Tensor], q8: Q8Library | None = None):
        self.tensors, self.kernels, self.device, self.int8, self.q8 = tensors, kernels, device, int8, q8
        self.arena = HugePageArena()  # the native weights, one after another in huge pages
        self.quantized = False  # whether any int8 copy was made here rather than found

    def __call__(self, *names: str) -> Linear:
        t = self.tensors
        weights = [t[f"{n}.weight"] for n in names]
        bias = torch.cat([t[f"{n}.bias"] for n in names]) if f"{names[0]}.bias" in t else None
        int8 = None
        if "int8" in self.kernels:
            parts = [self._int8(n) for n in names]
            int8 = (torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))
        native = self._gguf_packed(names, weights) if "q8" in self.kernels and self.q8 is not None else None
        return Linear(Stacked(weights) if len(weights) > 1 else weights[0], bias, self.kernels, self.device, int8,
                      self.q8, self.arena, native)

    def _gguf_packed(self, names: tuple[str, ...], weights: list):
        """The GGUF weights `weights` packed as they are, or None where they are not all GGUF
        weights of types with a native format (logged for the types)."""
        if not all(isinstance(w, GGUFWeight) for w in weights):
            return None
        missing = [f"{n} ({w.gguf_type.name})" for n, w in zip(names, weights) if w.gguf_type.name not in GGUF_KINDS]
        if missing:
            _log.warning("no native format for %s: packed as int8 blocks, exact where its values allow",
                         ", ".join(missing))
            return None
        runs = [list(run) for _, run in itertools.groupby(weights, key=lambda w: w.gguf_type)]
        parts = []
        for run in runs:  # neighbours of one type stacked into one packing
            blocks = np.concatenate([w.blocks for w in run]) if len(run) > 1 else run[0].blocks
            # A packed part's pages of the file would stay this process's memory till the load
            # ends: the largest tensor's part of the peak. Let go of them as it goes.
            alone = run[0] if len(run) == 1 and run[0].row_order is None else None
            parts.append(self.q8.pack_gguf(run[0].gguf_type.name, blocks, len(blocks), run[0].shape[1], self.arena,
                                           alone.release_pages if alone is not None else None))
            for w in run:
                w.release_pages()
        return parts[0] if len(parts) == 1 else self.q8.pack_parts(parts)

    def head(self, name: str) -> Linear:
        """The LM head: a Linear whose q8 copy finds greedy tokens on pruning copies of itself where
        that pays (Q8Library.prunes_argmax: on AVX2; 2.3x its bytes more)."""
        head = self(name)
        if head.native is not None and self.q8.prunes_argmax:
            self.q8.add_pruning(head.native, self.arena)
        return head

    def _int8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self.int8:
            self.int8[name], self.int8[f"{name}.scales"] = quantize_int8(self.tensors[f"{name}.weight"].float())
            self.quantized = True
        return self.int8[name], self.int8[f"{name}.scales"]


class Stacked:
    """Weights stacked along their outputs (q/k/v, gate/up), concatenated only where a float copy
    is made."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def float(self) -> torch.Tensor:
        return torch.cat([p.float() for p in self.parts])


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8; scales are bf16 as the int8 matmul kernel wants."""
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)
    q = torch.round(w / scales.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Rotary:
    """cos/sin tables for rotate-half RoPE, computed in float32 the way transformers does: of one
    half of a head, [positions, head_dim / 2], for the other half turns by the same angles.

    The tables cover the positions steps have reached (`cover`), doubling as they go up to
    max_positions: at a 32k context a table is tens of MB that most servers never read."""

    INITIAL_POSITIONS = 4096

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq, self.attention_factor = _scale_inv_freq(inv_freq, scaling)
        self.max_positions, self.device = max_positions, device
        self.half = head_dim // 2
        self.cos = self.sin = torch.empty(0, self.half)
        self.cover(min(max_positions, self.INITIAL_POSITIONS))
        self._rows = (None, None, None)  # (positions, cos, signed sin) of the step in flight

    def cover(self, positions: int) -> None:
        """Tables for positions 0..positions-1 at least (ValueError past max_positions). Each value
        is computed as when the table was made whole: a grown table holds the same bits."""
        if positions <= len(self.cos):
            return
        if positions > self.max_positions:
            raise ValueError(f"position {positions - 1} is past the model's {self.max_positions} positions")
        size = min(self.max_positions, max(positions, 2 * len(self.cos)))
        freqs = torch.outer(torch.arange(size, dtype=torch.int64).float(), self.inv_freq)
        sin, cos = freqs.sin(), freqs.cos()
        if self.attention_factor != 1.0:
            sin, cos = sin * self.attention_factor, cos * self.attention_factor
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]. Every layer of a step passes the same positions tensor:
        # look its rows up once per step, not once per layer.
        if self._rows[0] is not positions:
            # rotate_half(x) * sin == roll(x, half) * [-sin, sin], bit for bit, in fewer ops.
            cos, sin = self.cos[positions], self.sin[positions]
            self._rows = (positions, torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([-sin, sin], -1).unsqueeze(1))
        _, cos, signed_sin = self._rows
        return x * cos + x.roll(self.half, dims=-1) * signed_sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> tuple[torch.Tensor, float]:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: a divisor per dimension pair
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r}")


@dataclass
class AttentionView:
    """Which cached keys one group of queries reads, for one layer type (full or sliding)."""

    slots: torch.Tensor  # [B, L] flat cache slots; L a multiple of ATTENTION_BLOCK, starting at an aligned position
    bias: torch.Tensor  # [B, 1, n, L] additive mask: 0 or -inf


@dataclass
class PrefillSpan:
    row_start: int  # first row of this sequence's tokens in the step
    num_rows: int
    views: dict[str, AttentionView]  # layer type -> view (B = 1)


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer: views of the gathered keys
    for the torch path (`paged_attention`), block tables for the native one (row_ops.py)."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    positions: torch.Tensor  # [T]
    num_decode: int = 0  # rows 0..num_decode-1 are single-token decodes
    decode_views: dict[str, AttentionView] = field(default_factory=dict)  # layer type -> [num_decode, 1, 1, L]
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 0
    tables: torch.Tensor | None = None  # [S, W] the block tables of the step's sequences
    table_rows: torch.Tensor | None = None  # [T] each token's row in `tables`


class KVCache:
    """One layer's paged K and V: [num_blocks * block_size, kv_heads, head_dim] flat slots.

    Left uninitialized (zeroing 1 GB costs seconds at start): attention only gathers
    positions its own sequence has already written; padding re-reads position 0."""

    def __init__(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots, kv_heads, head_dim)
        if device.type == "cpu":  # in huge pages: attention reads scattered blocks of it every step
            nbytes = num_slots * kv_heads * head_dim * dtype.itemsize
            self.k, self.v = (huge_page_empty(nbytes).view(dtype).view(shape) for _ in range(2))
        else:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty_like(self.k)


def paged_attention(
    q: torch.Tensor,  # [T, heads, D], already rotated
    k: torch.Tensor,  # [T, kv_heads, D]
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    layer_type: str,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    cache.k.index_copy_(0, meta.slot_mapping, k.to(cache.k.dtype))
    cache.v.index_copy_(0, meta.slot_mapping, v.to(cache.v.dtype))
    out = torch.empty_like(q)
    if meta.num_decode:
        rows = slice(0, meta.num_decode)
        out[rows] = _attend(q[rows].unsqueeze(1), cache, meta.decode_views[layer_type], scale, softcap).squeeze(1)
    for span in meta.prefills:
        rows = slice(span.row_start, span.row_start + span.num_rows)
        out[rows] = _attend(q[rows].unsqueeze(0), cache, span.views[layer_type], scale, softcap).squeeze(0)
    return out


def _attend(q: torch.Tensor, cache: KVCache, view: AttentionView, scale: float, softcap: float | None) -> torch.Tensor:
    """q: [B, n, heads, D] against the gathered keys of `view`; returns [B, n, heads, D]."""
    b, n, heads, d = q.shape
    kv_heads = cache.k.shape[1]
    group = heads // kv_heads
    length = view.slots.shape[1]
    blocks = length // ATTENTION_BLOCK
    rows = group * n
    pad = -rows % _ROW_MULTIPLE
    flat = view.slots.reshape(-1)
    keys = cache.k.index_select(0, flat).view(b, length, kv_heads, d).float()
    values = cache.v.index_select(0, flat).view(b, length, kv_heads, d).float()
    # The query heads of one KV group share a matmul: [B, kv, group*n (+pad), D] @ [B, kv, D, L].
    qg = q.view(b, n, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, rows, d)
    if pad:
        qg = torch.cat([qg, qg.new_zeros(b, kv_heads, pad, d)], dim=2)
    scores = (qg @ keys.permute(0, 2, 3, 1))[:, :, :rows] * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv_heads, group, n, length) + view.bias.unsqueeze(1)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).view(b, kv_heads, rows, blocks, ATTENTION_BLOCK)
    if pad:
        probs = torch.cat([probs, probs.new_zeros(b, kv_heads, pad, blocks, ATTENTION_BLOCK)], dim=2)
    probs = probs.permute(0, 1, 3, 2, 4)  # [B, kv, blocks, rows, block]
    partial = probs @ values.view(b, blocks, ATTENTION_BLOCK, kv_heads, d).permute(0, 3, 1, 2, 4)
    partial_sums = probs.sum(dim=-1)
    out, total = partial[:, :, 0], partial_sums[:, :, 0]
    for i in range(1, blocks):
        out, total = out + partial[:, :, i], total + partial_sums[:, :, i]
    out = (out / total.unsqueeze(-1))[:, :, :rows]
    return out.view(b, kv_heads, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, heads, d)


class Attention:
    """Fused q/k/v projection, optional QK-norm, RoPE, paged attention, output projection."""

    def __init__(self, t: dict, build: LinearBuilder, prefix: str, cfg, layer_type: str, rotary: Rotary,
                 ops: TorchRowOps, device):
        self.ops = ops
        self.qkv_proj = build(f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj")
        self.o_proj = build(f"{prefix}.o_proj")
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q and k are normed and rotated as one [T, heads + kv_heads, D] tensor: half the ops.
        self.qk_norm = None
        if cfg.qk_norm:
            q_w = norm_weight(t[f"{prefix}.q_norm.weight"], cfg.norm_offset, device)
            k_w = norm_weight(t[f"{prefix}.k_norm.weight"], cfg.norm_offset, device)
            self.qk_norm = torch.stack([q_w] * self.heads + [k_w] * self.kv_heads)
        self.v_start = (self.heads + self.kv_heads) * self.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping
        self.layer_type = layer_type
        self.window = cfg.sliding_window if layer_type == "sliding" else 0
        self.rotary = rotary

    def __call__(self, x, positions, cache: KVCache, meta: AttentionMetadata, kernel: str) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x, kernel)
        qk = self.ops.qk_norm_rope(qkv, self.heads + self.kv_heads, self.head_dim, self.qk_norm, self.eps,
                                   self.rotary, positions)
        v = qkv[:, self.v_start:].view(t, self.kv_heads, self.head_dim)
        out = self.ops.attention(qk, v, self.heads, cache, meta, self.layer_type, self.window, self.scale, self.softcap)
        return self.o_proj(out.reshape(t, self.heads * self.head_dim), kernel)


class MLP:
    """Gated MLP with the gate and up projections fused into one matmul."""

    def __init__(self, t: dict, build: LinearBuilder, prefix: str, activation: str, ops: TorchRowOps):
        self.ops = ops
        self.activation = activation
        self.width = t[f"{prefix}.gate_proj.weight"].shape[0]
        self.gate_up = build(f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.down = build(f"{prefix}.down_proj")

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        return self.down(self.ops.gated(self.gate_up(x, kernel), self.width, self.activation), kernel)
