"""The row-wise operations of a decoder layer, everything but its matmuls: RMS norms, the
residual update, QK-norm with RoPE, paged attention and the gated activation.

Two implementations with one interface: `TorchRowOps` (the reference, and the path on a GPU)
and `NativeRowOps`, the same operations in C (row_ops.c), compiled at first use with the
system's C compiler and cached. At batch 1 a decoder layer runs about sixty tiny torch ops
and torch's per-op dispatch, not the arithmetic, is most of the step outside the matmuls;
one C call per operation removes it. Without a compiler the torch path is used.

Both are row-wise: a token's output depends only on its own inputs (and, for attention, its
sequence's cache), never on the batch. The two agree to float rounding, not bit for bit, so
one engine uses one of them throughout. `add_rms_norm` updates x in place (x is always the
step's own activation tensor).
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn.functional as F

from tollway.model.layers import AttentionMetadata, KVCache, paged_attention
from tollway.model.native.build import native_code_enabled, native_flags, start_build
from tollway.model.native.qmatmul import Q8Library, q8_library
from tollway.model.native_layers import ACTIVATIONS, NativeLayers, pointer
from tollway.model.step_yield import Paused, StepYield
from tollway.checkpoint import cache_root

_SOURCE = Path(__file__).with_name("row_ops.c")
_HEADERS = (Path(__file__).with_name("fast_exp.h"),)


class TorchRowOps:
    needs_views = True  # reads AttentionMetadata's gathered-key views
    pauses = False  # a step can stop between layers (run_layers' `pause`)
    build = "torch"  # what runs a step: a step profile timed one build, and another times differently

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, h_weight: torch.Tensor | None,
                     weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """x += rms_norm(h) * h_weight (or x += h when h_weight is None), in place; returns
        rms_norm(x) * weight, or None when weight is None."""
        x.add_(self.rms_norm(h, h_weight, eps) if h_weight is not None else h)
        return self.rms_norm(x, weight, eps) if weight is not None else None

    def qk_norm_rope(self, qkv: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor | None, eps: float,
                     rotary, positions: torch.Tensor) -> torch.Tensor:
        """The first `heads` heads of each qkv row, normed per head (weight: [heads, head_dim])
        when weight is given, then rotated: a new [T, heads, head_dim] tensor."""
        qk = qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim)
        if weight is not None:
            qk = F.rms_norm(qk, (head_dim,), None, eps) * weight
        return rotary(qk, positions)

    def attention(self, qk: torch.Tensor, v: torch.Tensor, heads: int, cache: KVCache, meta: AttentionMetadata,
                  layer_type: str, window: int, scale: float, softcap: float | None) -> torch.Tensor:
        """Writes the step's k ([T, heads:] of qk) and v to the cache, then attends with the
        query heads ([T, :heads] of qk): [T, heads, head_dim]. `window` 0 is full attention;
        the torch path reads it from the views instead."""
        return paged_attention(qk[:, :heads], qk[:, heads:], v, cache, meta, layer_type, scale, softcap)

    def gated(self, gate_up: torch.Tensor, width: int, activation: str) -> torch.Tensor:
        gate, up = gate_up.split(width, dim=-1)
        act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
        return act * up

    def run_layers(self, layers: list, x: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
                   kernel: str, keep: torch.Tensor | None = None, start: int = 0,
                   pause: StepYield | None = None) -> int | None:
        """x through layers `start`.. in one call, in place, where this path has one: the layers
        it went through (fewer than all where `pause` stopped it); None: the caller runs the
        layers one by one. With `keep` (row indices, ascending), x's first len(keep) rows are
        then those rows' outputs (see native_layers.py)."""
        return None

    def greedy_step(self, model, input_ids: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
                    kernel: str, keep: torch.Tensor | None = None,
                    pause: StepYield | None = None) -> list[int] | Paused | None:
        """model.greedy_forward's tokens in one call, where this path has one (Paused where
        `pause` stopped it between layers); None: the caller runs forward and then the head."""
        return None


class NativeRowOps(TorchRowOps):
    """The same operations through row_ops.c, for float32 tensors on the CPU."""

    needs_views = False  # reads AttentionMetadata's block tables
    pauses = True

    def __init__(self, lib: ctypes.CDLL, q8: Q8Library):
        self.build = f"{Path(lib._name).stem}+{q8.build}"
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
        self._rms_norm = _bind(lib.rms_norm, p, i64, p, f32, i64, i64, p)
        self._add_rms_norm = _bind(lib.add_rms_norm, p, p, p, p, f32, i64, i64, p)
        self._qk_norm_rope = _bind(lib.qk_norm_rope, p, i64, i64, i64, i64, p, f32, p, p, p, p)
        self._gated = _bind(lib.gated_act, p, i64, i64, ctypes.c_int32, p)
        self._write_kv = _bind(lib.write_kv, p, i64, p, i64, i64, i64, p, p, p, i32)
        self._attention = _bind(lib.paged_attention_parallel, p, i64, i64, i64, i64, i64, p, p, p, i64, p, p, i64,
                                i64, f32, f32, p, i32, p, i32)
        self._parallel = q8.address("q8_parallel")  # the matmuls' thread pool
        self._layers = NativeLayers(lib, q8)

    def rms_norm(self, x, weight, eps):
        if x.dim() != 2 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), pointer(weight), eps, x.shape[0], x.shape[1], out.data_ptr())
        return out

    def add_rms_norm(self, x, h, h_weight, weight, eps):
        h = h.contiguous()
        normed = torch.empty_like(x) if weight is not None else None
        self._add_rms_norm(x.data_ptr(), h.data_ptr(), pointer(h_weight), pointer(weight), eps, x.shape[0], x.shape[1],
                           pointer(normed))
        return normed

    def qk_norm_rope(self, qkv, heads, head_dim, weight, eps, rotary, positions):
        out = torch.empty(qkv.shape[0], heads, head_dim)
        self._qk_norm_rope(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, head_dim, pointer(weight), eps,
                           rotary.cos.data_ptr(), rotary.sin.data_ptr(), positions.data_ptr(), out.data_ptr())
        return out

    def attention(self, qk, v, heads, cache, meta, layer_type, window, scale, softcap):
        tokens, _, d = qk.shape
        kv_heads = qk.shape[1] - heads
        k = qk[:, heads:]
        half = cache.k.dtype == torch.float16
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), tokens, kv_heads * d,
                       meta.slot_mapping.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), half)
        out = torch.empty(tokens, heads, d)
        self._attention(qk.data_ptr(), qk.stride(0), tokens, heads, kv_heads, d, cache.k.data_ptr(),
                        cache.v.data_ptr(), meta.tables.data_ptr(), meta.tables.shape[1], meta.table_rows.data_ptr(),
                        meta.positions.data_ptr(), meta.block_size, window, scale, softcap or 0.0, out.data_ptr(),
                        half, self._parallel, torch.get_num_threads())
        return out

    def gated(self, gate_up, width, activation):
        out = torch.empty(gate_up.shape[0], width)
        self._gated(gate_up.data_ptr(), gate_up.shape[0], width, ACTIVATIONS[activation], out.data_ptr())
        return out

    def run_layers(self, layers, x, caches, meta, kernel, keep=None, start=0, pause=None):
        return self._layers.run(layers, x, caches, meta, kernel, keep, start, pause)

    def greedy_step(self, model, input_ids, caches, meta, kernel, keep=None, pause=None):
        return self._layers.run_greedy(model, input_ids, caches, meta, kernel, keep, pause)


def _bind(fn, *argtypes):
    fn.argtypes, fn.restype = list(argtypes), None
    return fn


def row_ops_for(device: torch.device, head_dim: int, cache_dir: str | os.PathLike | None = None) -> TorchRowOps:
    """The native kernels on a CPU where they compile (set TOLLWAY_NATIVE=0 to turn them off),
    torch otherwise. They run on the integer matmuls' thread pool, so they need that library too."""
    # The attention kernel reads heads in 16-float pieces.
    if device.type != "cpu" or head_dim % 16 or not native_code_enabled():
        return TorchRowOps()
    q8 = q8_library(cache_dir)
    lib = row_ops_library(cache_root(cache_dir) / "native", q8.forced if q8 else None)
    return NativeRowOps(ctypes.CDLL(str(lib)), q8) if lib and q8 else TorchRowOps()


def row_ops_library(folder: Path, forced_isa: str | None = None) -> Path | None:
    """row_ops.c built for this machine, or for the CPU kind a forced instruction set stands for
    (see native/build.py); None without a working compiler."""
    return row_ops_build(folder, forced_isa).result()


def row_ops_build(folder: Path, forced_isa: str | None = None) -> Future:
    """The build of row_ops.c (build.start_build): the path of the library to come, or None."""
    return start_build(_SOURCE, folder, native_flags(forced_isa), _HEADERS, fallback="torch for the row-wise ops")
