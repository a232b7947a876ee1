"""A step's decoder layers in one native call (row_ops.c's `decoder_layers`) for q8 steps.

The layer classes (gemma3.py, llama.py) run a layer as about ten calls: norms, matmuls, RoPE,
attention. At batch 1 the Python and ctypes between those calls cost more than the row-wise
work itself, so where every matmul of the model has a native weight for the step's kernel,
the whole loop runs in C: the same operations in the same order, so the same bits. The row-wise
work and attention run on the matmuls' thread pool (qmatmul.c), split by rows once a step is big
enough to pay for it.
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from tollway.model.layers import AttentionMetadata, KVCache, Linear
from tollway.model.native.qmatmul import ISAS, KINDS, PARTS, Q8Library
from tollway.model.step_yield import Paused, StepYield

ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}  # row_ops.c's gated_act kinds
KEPT_SCRATCH_TOKENS = 256

_p, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class _Linear(ctypes.Structure):
    _fields_ = [("matmul", _p), ("packed", _p), ("bias", _p), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):  # row_ops.c's `layer`
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _p), ("post_attn_norm", _p), ("pre_ff_norm", _p), ("post_ff_norm", _p),
                ("qk_norm", _p), ("cos", _p), ("sin", _p), ("k_cache", _p), ("v_cache", _p),
                ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("width", _i64), ("window", _i64),
                ("eps", _f32), ("scale", _f32), ("softcap", _f32), ("activation", _i32), ("kv_half", _i32)]


class _Ends(ctypes.Structure):  # row_ops.c's `ends`
    _fields_ = [("embed_rows", _p), ("embed", _p), ("embed_row_bytes", _i64), ("embed_type", _i32), ("embed_scale", _p),
                ("final_norm", _p), ("eps", _f32), ("argmax", _p), ("head", _p), ("vocab", _i64)]


class _Step(ctypes.Structure):  # row_ops.c's `step`
    _fields_ = [("tokens", _i64), ("hidden", _i64), ("positions", _p), ("slots", _p), ("tables", _p),
                ("table_rows", _p), ("table_width", _i64), ("block_size", _i64),
                ("kept", _i64), ("keep", _p), ("kept_positions", _p), ("kept_table_rows", _p),
                ("normed", _p), ("qkv", _p), ("qk", _p), ("attn", _p), ("h", _p), ("gate_up", _p), ("act", _p),
                ("parallel", _p), ("isa", _i32), ("threads", _i32),
                ("first_layer", _i64), ("yield_flag", _p), ("yield_at_ns", _i64)]


def pointer(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeLayers:
    """Runs every layer of a model in one call per step, per kernel whose weights allow it."""

    def __init__(self, row_ops: ctypes.CDLL, q8: Q8Library):
        self.q8 = q8
        self._run = row_ops.decoder_layers
        self._run.argtypes, self._run.restype = [_p, _i64, _p, _p], _i64
        self._greedy = row_ops.decoder_greedy
        self._greedy.argtypes, self._greedy.restype = [_p, _i64, _p, _p, _p, _p, _p], _i64
        self._matmul = {kind: q8.address(f"{kind}_matmul") for kind in (*KINDS, PARTS)}
        self._embed_rows = q8.address("gguf_rows")
        self._argmax = {kind: q8.address(f"{kind}_matmul_argmax") for kind in KINDS}
        self._parallel = q8.address("q8_parallel")
        # (kernel, id of the caches) -> (descriptors or None, the caches: their id stays theirs)
        self._layers: dict[tuple[str, int, int], tuple[ctypes.Array | None, list[KVCache]]] = {}
        self._ends: dict[str, tuple[_Ends, weakref.ref]] = {}  # kernel -> (the model's ends, the model)
        self._buffer = torch.empty(0)
        self._tokens = np.empty(KEPT_SCRATCH_TOKENS, dtype=np.int64)  # decode-sized steps' greedy tokens

    def run(self, layers: list, x: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata, kernel: str,
            keep: torch.Tensor | None = None, start: int = 0, pause: StepYield | None = None) -> int | None:
        """x through layers `start`.. in place; with `keep` (row indices, ascending), x's first
        len(keep) rows are then those rows' outputs, and the last layer runs only their
        attention and MLP. Returns the layers x has been through: all of them, or fewer where
        `pause` asked the step to stop (x is then every row after those layers, to be run on
        from there). None (nothing done) where this kernel has a layer without native weights,
        or the step does not carry the block tables."""
        call = self._call(layers, caches, meta, kernel, x.shape[0], x.shape[1], keep, start, pause)
        if call is None:
            return None
        described, step, _alive, _ = call
        done = self._run(described, len(layers), ctypes.byref(step), x.data_ptr())
        if done < 0:
            raise MemoryError("decoder_layers: a matmul could not allocate its activation buffer")
        return done

    def run_greedy(self, model, input_ids: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
                   kernel: str, keep: torch.Tensor | None = None,
                   pause: StepYield | None = None) -> list[int] | Paused | None:
        """The greedy token of each row in `keep` (or of every row) of `model` (a DecoderModel whose
        LM head has a native packing for `kernel`), from its embedding rows of `input_ids` to the
        head's argmax, in one call; every row's K and V go to the caches. Paused where `pause`
        stopped it between layers: every row's hidden state then, to be run on by `run`. None
        (nothing done) where `run` would return None."""
        hidden = model.embed.hidden
        if model.embed.table is None:
            return None
        call = self._call(model.layers, caches, meta, kernel, len(input_ids), hidden, keep, 0, pause)
        if call is None:
            return None
        described, step, alive, x = call
        ends, owner = self._ends.get(kernel, (None, None))
        if owner is None or owner() is not model:
            head = model.lm_head.packed(kernel)
            embed = model.embed
            ends = _Ends(self._embed_rows, embed.address, embed.row_bytes, embed.type_code, pointer(embed.scale),
                         pointer(model.final_norm), model.eps, self._argmax[head.kind], head.data.data_ptr(),
                         head.out_features)
            # by a weak reference: the model holds these ops, so a strong one would keep both alive
            self._ends[kernel] = (ends, weakref.ref(model))
        rows = len(input_ids) if keep is None else len(keep)
        tokens = self._tokens if rows <= len(self._tokens) else np.empty(rows, dtype=np.int64)
        done = self._greedy(described, len(model.layers), ctypes.byref(ends), ctypes.byref(step),
                            input_ids.data_ptr(), x, tokens.ctypes.data)
        if done < 0:
            raise MemoryError("decoder_greedy: a matmul could not allocate its activation buffer")
        if done < len(model.layers):  # x lives in the scratch, which the next step reuses: copied out
            scratch = alive[0]
            at = (x - scratch.data_ptr()) // scratch.element_size()
            return Paused(scratch[at:at + len(input_ids) * hidden].view(len(input_ids), hidden).clone(), done)
        return tokens[:rows].tolist()

    def _call(self, layers: list, caches: list[KVCache], meta: AttentionMetadata, kernel: str, tokens: int,
              hidden: int, keep: torch.Tensor | None, start: int, pause: StepYield | None):
        """(the layers' descriptors, the step, what must stay alive until the call returns, the
        address of the scratch's rows for x (decoder_greedy's)), or None where this kernel has a
        layer without native weights, or the step does not carry the block tables."""
        if meta.tables is None:
            return None
        # the rotary tables' address: a table that grew (Rotary.cover) is described anew
        key = (kernel, id(caches), layers[0].attn.rotary.cos.data_ptr())
        if key not in self._layers:
            for stale in [k for k in self._layers if k[:2] == key[:2]]:
                del self._layers[stale]
            self._layers[key] = (self._describe(layers, caches, kernel), caches)
        described = self._layers[key][0]
        if described is None:
            return None
        scratch, rows = self._scratch(layers[0], tokens, hidden)
        alive, kept = [scratch], (0, None, None, None)
        if keep is not None:
            kept_positions, kept_table_rows = meta.positions[keep], meta.table_rows[keep]
            alive += [kept_positions, kept_table_rows]
            kept = (len(keep), keep.data_ptr(), kept_positions.data_ptr(), kept_table_rows.data_ptr())
        step = _Step(tokens, hidden, meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.tables.data_ptr(),
                     meta.table_rows.data_ptr(), meta.tables.shape[1], meta.block_size, *kept, *rows[:-1],
                     self._parallel, ISAS.index(self.q8.isa), torch.get_num_threads(), start,
                     pause.flag_address if pause is not None else None, pause.deadline_ns() if pause is not None else 0)
        return described, step, alive, rows[-1]

    def _scratch(self, first, tokens: int, hidden: int) -> tuple[torch.Tensor, list[int]]:
        """The step's scratch, and the addresses of its rows in _Step's order, then of x's rows
        (for decoder_greedy). Decode-sized steps reuse one buffer, so they do not fault in fresh
        pages every step (3 MB of them at 64 decodes); a long prefill's buffer is freed with its
        step, so it does not stay resident."""
        d, width = first.attn.head_dim, first.mlp.width
        widths = (hidden, first.attn.qkv_proj.out_features, (first.attn.heads + first.attn.kv_heads) * d,
                  first.attn.heads * d, hidden, 2 * width, width, hidden)
        need = tokens * sum(widths)
        if tokens > KEPT_SCRATCH_TOKENS:
            buffer = torch.empty(need)
        else:
            if self._buffer.numel() < need:
                self._buffer = torch.empty(KEPT_SCRATCH_TOKENS * sum(widths))
            buffer = self._buffer
        base, offsets = buffer.data_ptr(), []
        for w in widths:
            offsets.append(base)
            base += tokens * w * buffer.element_size()
        return buffer, offsets

    def _describe(self, layers: list, caches: list[KVCache], kernel: str) -> ctypes.Array | None:
        first = layers[0]
        shapes = (first.attn.qkv_proj.out_features, first.mlp.width, first.attn.head_dim)
        out = (_Layer * len(layers))()
        for desc, layer, cache in zip(out, layers, caches):
            attn, mlp = layer.attn, layer.mlp
            if (attn.qkv_proj.out_features, mlp.width, attn.head_dim) != shapes:
                return None  # the scratch is sized from the first layer
            linears = []
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up, mlp.down):
                linear = self._linear(lin, kernel)
                if linear is None:
                    return None
                linears.append(linear)
            desc.qkv, desc.o, desc.gate_up, desc.down = linears
            (desc.input_norm, desc.post_attn_norm, desc.pre_ff_norm,
             desc.post_ff_norm) = (pointer(n) for n in layer.norms)
            desc.qk_norm = pointer(attn.qk_norm)
            desc.cos, desc.sin = attn.rotary.cos.data_ptr(), attn.rotary.sin.data_ptr()
            desc.k_cache, desc.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
            desc.heads, desc.kv_heads, desc.head_dim = attn.heads, attn.kv_heads, attn.head_dim
            desc.width, desc.window = mlp.width, attn.window
            desc.eps, desc.scale, desc.softcap = attn.eps, attn.scale, attn.softcap or 0.0
            desc.activation = ACTIVATIONS[mlp.activation]
            desc.kv_half = cache.k.dtype == torch.float16
        return out

    def _linear(self, lin: Linear, kernel: str) -> _Linear | None:
        packed = lin.packed(kernel)
        if packed is None:
            return None
        return _Linear(self._matmul[packed.kind], packed.data.data_ptr(), pointer(lin.bias), packed.out_features,
                       packed.in_features)
