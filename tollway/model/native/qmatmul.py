"""The CPU's integer matmuls (qmatmul.c): y = x @ W.T with W packed once into tiles of blocks of 32
along K, and x quantized to int8 blocks of 32 at every call. The weight formats (KINDS) are a GGUF
file's own, each at its own width: q8 (Q8_0, and float weights quantized to int8 with an fp16 scale
per block), q5 (Q5_0), q4k (Q4_K), q6k (Q6_K), q5k (Q5_K) and q40 (Q4_0). A GGUF tensor of one of
GGUF_KINDS' types is packed from its blocks as they are (pack_gguf): the same values, laid out for
the kernels.

The instruction set is picked at run time from the CPU's flags: AVX512-VNNI, then 256-bit VNNI
(AVX-VNNI), then AVX2, then portable C. TOLLWAY_ISA, or the `isa` argument, forces a lower one,
so a machine with the highest can test them all; every path gives the same bits.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tollway.model.host_memory import HugePageArena
from tollway.model.native.build import native_code_enabled, start_build
from tollway.checkpoint import cache_root

_log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
# One library of them all, named after qmatmul.c (the matmul itself); qmatmul.h says which does what.
_SOURCES = (_HERE / "qmatmul.c", *sorted(p for p in _HERE.glob("qmatmul_*.c")))
_HEADERS = tuple(sorted(_HERE.glob("*.h")))
# No -march=native: each kernel carries its own target attribute, so the lower paths stay what
# they claim to be. No FMA contraction: the float sums are written out, the same in every path.
_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off"]
ISAS = ("portable", "avx2", "avxvnni", "avx512vnni")  # in the order of qmatmul.c's enum isa
KINDS = ("q8", "q5", "q4k", "q6k", "q5k", "q40")  # the weight formats
# The GGUF tensor types packed as they are, and the format each becomes.
GGUF_KINDS = {"Q8_0": "q8", "Q5_0": "q5", "Q4_K": "q4k", "Q6_K": "q6k", "Q5_K": "q5k", "Q4_0": "q40"}
BLOCK = 32  # K values per scale
TILE = 16  # output rows per tile
PACK_CHUNK_BYTES = 32 << 20  # of a GGUF tensor's blocks packed at a time (Q8Library.pack_gguf)
# The fewest rows a pruned argmax runs for (Q8Library.add_pruning): below, the exact head is
# bound by reading its weights, which the pruned one reads more of.
PRUNED_ARGMAX_ROWS = 4
# Rows of nearly flat logits (a model fed random tokens) leave thousands of columns within reach
# of the top, and run the exact matmul after the coarse one, which then costs more than the exact
# one alone: after a call where more than a quarter of the rows did, this many calls skip pruning.
PRUNING_PAUSE_CALLS = 16


class Q8Library:
    """The compiled qmatmul.c: packs weights, and runs them on the chosen instruction set."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._packed_bytes = _bind(lib.q8_packed_bytes, i64, i64, i64)
        self._pack = _bind(lib.q8_pack, i64, p, i64, i64, p, i32)
        self._gguf_packers = {kind: (_bind(getattr(lib, f"{kind}_packed_bytes"), i64, i64, i64),
                                     _bind(getattr(lib, f"{kind}_pack_gguf"), None, p, i64, i64, p, i64, i64, i32))
                              for kind in GGUF_KINDS.values()}  # (packed bytes, packer) per format
        self._kernels = {kind: (_bind(getattr(lib, f"{kind}_matmul"), i32, p, i64, i64, i64, p, i64, p, i64, i32, i32),
                                _bind(getattr(lib, f"{kind}_matmul_argmax"), i32, p, i64, i64, i64, p, i64, p, i32, i32))
                         for kind in KINDS}  # (matmul, argmax) per weight format
        self._kernels[PARTS] = (_bind(lib.parts_matmul, i32, p, i64, i64, i64, p, i64, p, i64, i32, i32), None)
        self._gguf_rows = _bind(lib.gguf_rows, i32, i32, p, i64, i64, p, i64, p, p, i64)
        self._gguf_rows_supported = _bind(lib.gguf_rows_supported, i32, i32)
        self._pack_pruning = _bind(lib.q8_pack_pruning, i32, p, i64, i64, p, p, p)
        self._signed_bytes = _bind(lib.signed_packed_bytes, i64, i64, i64)
        self._column_bytes = _bind(lib.q8_column_bytes, i64, i64)
        self._reach_floats = _bind(lib.q8_reach_floats, i64, i64, i64)
        self._argmax_pruned = _bind(lib.q8_matmul_argmax_pruned, i64, p, i64, i64, i64, p, p, p, p, i64, p, i32, i32)
        self._peak = _bind(lib.q8_peak, i64, i32, i64, i32)
        self._read = _bind(lib.q8_read, ctypes.c_uint64, p, i64, i32)
        self.supported = [name for i, name in enumerate(ISAS) if _bind(lib.q8_isa_supported, i32, i32)(i)]
        self.isa = self.resolve(os.environ.get("TOLLWAY_ISA") or None)
        # The instruction set forced below this CPU's best, else None: the other native code is
        # then built for it too (build.native_flags).
        self.forced = self.below_best(self.isa)
        # The cached build's name (it hashes the source and flags) and the instruction set that runs:
        # a step profile timed on one is no model of another (TOLLWAY_ISA=avx2 on an AVX-512 CPU).
        self.build = f"{Path(lib._name).stem}-{self.isa}"
        # Whether an LM head's argmax pays for pruning on a coarse copy here: where the coarse
        # values run a faster kernel than full-range int8 (AVX2's small-value one).
        self.prunes_argmax = bool(_bind(lib.q8_has_small_kernel, i32, i32)(ISAS.index(self.isa)))

    def resolve(self, isa: str | None) -> str:
        """`isa` when this CPU runs it, the best it runs when None."""
        if isa is None:
            return self.supported[-1]
        if isa not in self.supported:
            raise ValueError(f"instruction set {isa!r} is not available here (this CPU runs: {', '.join(self.supported)})")
        return isa

    def below_best(self, isa: str | None) -> str | None:
        """`isa` where this CPU runs it below its best (a forced path), None where it is the best
        or None; ValueError where this CPU does not run it."""
        isa = self.resolve(isa)
        return isa if isa != self.supported[-1] else None

    def address(self, name: str) -> int:
        """Where the library's function `name` is, for native code that calls it."""
        return ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value

    def pack(self, weight: torch.Tensor, arena: HugePageArena | None = None) -> PackedWeight:
        """weight: [N, K] on the CPU, packed into `arena` when given. ValueError when K is not a
        multiple of 32, or a block's scale would not fit fp16 (|w| past 8e6, or NaN)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
        w = weight.float().contiguous()
        data = _empty(self._packed_bytes(n, k), arena)
        if self._pack(w.data_ptr(), n, k, data.data_ptr(), torch.get_num_threads()):
            raise ValueError("weights beyond the range of fp16 block scales (or NaN)")
        return PackedWeight(self, "q8", data, n, k)

    def pack_gguf(self, gguf_type: str, blocks: np.ndarray, n: int, k: int, arena: HugePageArena | None = None,
                  packed_rows: Callable[[int, int], None] | None = None) -> PackedWeight:
        """A GGUF tensor [n, k] of `gguf_type` (a key of GGUF_KINDS), its rows' blocks as the file
        holds them (`blocks`: n rows of bytes, e.g. a view of the file's memory map), in its format.
        Packed PACK_CHUNK_BYTES of the file at a time, after each of which `packed_rows(start, end)`
        is told which rows are done (so their pages of the file can be let go)."""
        kind = GGUF_KINDS[gguf_type]
        packed_bytes, pack = self._gguf_packers[kind]
        blocks = np.ascontiguousarray(blocks)
        data = _empty(packed_bytes(n, k), arena)
        tiles = -(-n // TILE)
        step = max(1, PACK_CHUNK_BYTES // (blocks.strides[0] * TILE))
        for t0 in range(0, tiles, step):
            t1 = min(tiles, t0 + step)
            pack(blocks.ctypes.data, n, k, data.data_ptr(), t0, t1, torch.get_num_threads())
            if packed_rows is not None:
                packed_rows(t0 * TILE, min(n, t1 * TILE))
        return PackedWeight(self, kind, data, n, k)

    def pack_parts(self, parts: list[PackedWeight]) -> PackedWeight:
        """One linear of `parts` stacked along the outputs, each in its own format (a GGUF's q, k
        and v of different types): each part's matmul writes its own columns."""
        if len(parts) > _MAX_PARTS:
            raise ValueError(f"a linear of {len(parts)} parts (at most {_MAX_PARTS})")
        fields = [_Part(self.address(f"{w.kind}_matmul"), w.data.data_ptr(), w.out_features) for w in parts]
        desc = _Parts(len(parts), (_Part * _MAX_PARTS)(*fields))
        data = torch.frombuffer(bytearray(bytes(desc)), dtype=torch.uint8)
        packed = PackedWeight(self, PARTS, data, sum(w.out_features for w in parts), parts[0].in_features)
        packed.parts = parts  # the parts' packings live as long as the descriptor that points at them
        return packed

    def reads_gguf_rows(self, type_code: int) -> bool:
        """Whether gguf_rows reads tensors of this GGUF type (its number)."""
        return bool(self._gguf_rows_supported(type_code))

    def gguf_rows(self, type_code: int, table: np.ndarray, k: int, ids: torch.Tensor, scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` of a GGUF tensor of `type_code` ([rows, bytes per row], where the file holds
        it) as float32 [len(ids), k], times `scale` (a 0-d float32 tensor) where given."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(len(ids), k) if out is None else out
        if self._gguf_rows(type_code, table.ctypes.data, table.strides[0], k, ids.data_ptr(), len(ids),
                           scale.data_ptr() if scale is not None else None, out.data_ptr(), out.stride(0)):
            raise ValueError(f"gguf_rows does not read GGUF type {type_code}")
        return out

    def add_pruning(self, weight: PackedWeight, arena: HugePageArena | None = None) -> bool:
        """Gives q8 `weight` the copies its argmax prunes on at PRUNED_ARGMAX_ROWS rows or more
        (qmatmul_pruned_argmax.h): its values rounded to q / 8 in tiles of their own, a bound per
        column and block, and its exact values laid out by column; 2.3x the packing's bytes.
        False, and nothing added, for another kind or scales past fp16's range once times 8."""
        if weight.kind != "q8":
            return False
        n, k = weight.out_features, weight.in_features
        coarse = _empty(self._signed_bytes(n, k), arena)
        reach = torch.empty(self._reach_floats(n, k))
        columns = _empty(n * self._column_bytes(k), arena)
        if self._pack_pruning(weight.data.data_ptr(), n, k, coarse.data_ptr(), reach.data_ptr(), columns.data_ptr()):
            return False
        weight.pruning = Pruning(coarse, reach, columns)
        return True

    def pruned_argmax(self, x: torch.Tensor, weight: PackedWeight, isa: str | None = None) -> tuple[torch.Tensor, int]:
        """argmax(x, weight) found on its pruning copies (add_pruning), always the same columns, and
        how many rows the bounds left to the exact matmul."""
        x = _rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        p = weight.pruning
        exact_rows = self._argmax_pruned(x.data_ptr(), x.stride(0), x.shape[0], weight.in_features, weight.data.data_ptr(),
                                         p.coarse.data_ptr(), p.reach.data_ptr(), p.columns.data_ptr(), weight.out_features,
                                         out.data_ptr(), self._isa_index(isa), torch.get_num_threads())
        self._check(exact_rows < 0)
        return out, exact_rows

    def matmul(self, x: torch.Tensor, weight: PackedWeight, isa: str | None = None) -> torch.Tensor:
        """x: [M, K] float32 (rows may be strided) -> [M, N] float32."""
        x = _rows(x)
        y = torch.empty(x.shape[0], weight.out_features)
        matmul, _ = self._kernels[weight.kind]
        self._check(matmul(x.data_ptr(), x.stride(0), x.shape[0], weight.in_features, weight.data.data_ptr(),
                           weight.out_features, y.data_ptr(), y.stride(0), self._isa_index(isa), torch.get_num_threads()))
        return y

    def argmax(self, x: torch.Tensor, weight: PackedWeight, isa: str | None = None) -> torch.Tensor:
        """The column of each row's largest output of matmul(x, weight), the first on ties, without
        writing the outputs: [M] int64."""
        x = _rows(x)
        p = weight.pruning
        if weight.prunes(x.shape[0]):
            if not p.paused:
                out, exact_rows = self.pruned_argmax(x, weight, isa)
                p.paused = PRUNING_PAUSE_CALLS if exact_rows * 4 > x.shape[0] else 0
                return out
            p.paused -= 1
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _, argmax = self._kernels[weight.kind]
        self._check(argmax(x.data_ptr(), x.stride(0), x.shape[0], weight.in_features, weight.data.data_ptr(),
                           weight.out_features, out.data_ptr(), self._isa_index(isa), torch.get_num_threads()))
        return out

    def _isa_index(self, isa: str | None) -> int:
        return ISAS.index(self.isa if isa is None else self.resolve(isa))

    @staticmethod
    def _check(failed: int) -> None:
        if failed:
            raise MemoryError("qmatmul.c could not allocate its activation buffer")

    def dot_peak(self, iters: int = 1_000_000) -> float:
        """u8 x s8 multiply-adds per second of a register-only loop on every thread: the integer
        peak that benchmarks measure the kernels against, on the instruction set the kernels run
        (TOLLWAY_ISA=avx2 on an AVX-512 CPU is measured against AVX2's)."""
        isa, threads = ("avx512vnni" if self.isa == "avx512vnni" else "avx2"), torch.get_num_threads()
        best = 0.0
        for _ in range(5):  # the first starts the pool's threads; the best of the rest is the peak
            start = time.perf_counter()
            per_thread = self._peak(ISAS.index(isa), iters, threads)
            best = max(best, per_thread * threads / (time.perf_counter() - start))
        return best

    def read_peak(self, buffer: torch.Tensor, repeats: int = 5) -> float:
        """Bytes per second that every thread, reading its share of `buffer` (resident, far beyond
        any cache), takes from memory, the best of `repeats`: what a one-row decode step's weights
        stream at."""
        nbytes, threads, best = buffer.numel() * buffer.element_size(), torch.get_num_threads(), 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            self._read(buffer.data_ptr(), nbytes, threads)
            best = max(best, nbytes / (time.perf_counter() - start))
        return best


PARTS = "parts"  # a linear of parts in different formats (Q8Library.pack_parts)
_MAX_PARTS = 4  # qmatmul.c's MAX_PARTS


class _Part(ctypes.Structure):  # qmatmul.c's parts_weight.parts[i]
    _fields_ = [("matmul", ctypes.c_void_p), ("packed", ctypes.c_void_p), ("n", ctypes.c_int64)]


class _Parts(ctypes.Structure):  # qmatmul.c's parts_weight
    _fields_ = [("count", ctypes.c_int64), ("parts", _Part * _MAX_PARTS)]


class PackedWeight:
    """One weight matrix packed as `kind`, one of KINDS (see qmatmul.c for the layouts)."""

    def __init__(self, library: Q8Library, kind: str, data: torch.Tensor, out_features: int, in_features: int):
        self.library, self.kind, self.data = library, kind, data
        self.out_features, self.in_features = out_features, in_features
        self.pruning: Pruning | None = None  # see Q8Library.add_pruning
        self.parts: list[PackedWeight] = []  # a PARTS weight's parts

    def __call__(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        return self.library.matmul(x, self, isa)

    def argmax(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        return self.library.argmax(x, self, isa)

    def prunes(self, rows: int) -> bool:
        """Whether argmax at `rows` rows takes the pruned way, or counts down a pause of it: else it
        is the kind's plain argmax kernel alone."""
        return self.pruning is not None and rows >= PRUNED_ARGMAX_ROWS

    def streamed_bytes(self) -> int:
        """What a call reads of this weight: all of its packing (of its parts' packings)."""
        return sum(p.streamed_bytes() for p in self.parts) if self.parts else self.data.numel()


@dataclass
class Pruning:
    """A q8 weight's copies for a pruned argmax (Q8Library.add_pruning), and how many more calls
    skip it (PRUNING_PAUSE_CALLS)."""
    coarse: torch.Tensor
    reach: torch.Tensor
    columns: torch.Tensor
    paused: int = 0


def _empty(nbytes: int, arena: HugePageArena | None) -> torch.Tensor:
    return arena.empty(nbytes) if arena is not None else torch.empty(nbytes, dtype=torch.uint8)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def _bind(fn, restype, *argtypes):
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


@functools.lru_cache(maxsize=None)
def q8_library(cache_dir: str | os.PathLike | None = None) -> Q8Library | None:
    """The integer matmul built for this machine, once per process; None without a working C
    compiler (one warning line) or with TOLLWAY_NATIVE=0: the q8 kernel then runs on torch."""
    if not native_code_enabled():
        return None
    lib = q8_build(cache_dir).result()
    return Q8Library(ctypes.CDLL(str(lib))) if lib else None


def q8_build(cache_dir: str | os.PathLike | None = None) -> Future:
    """The build of the integer matmul (build.start_build): the path of the library to come, or None."""
    return start_build(_SOURCES, cache_root(cache_dir) / "native", _FLAGS, _HEADERS, fallback="torch fp32 for the q8 kernel")
