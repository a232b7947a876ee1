"""The CPU's integer matmuls (qmatmul.c): y = x @ W.T with W packed once into blocks of 32 along K,
and x quantized to int8 blocks of 32 at every call. Three weight formats: q8 (int8 with an fp16
scale), q4 (4-bit values 0..15 with an fp32 scale and min, w = scale * q - min: 6 bits a weight
against q8's 8.5) and q5 (5-bit values 0..31 with an fp16 scale, w = d * (q - 16): 5.5 bits);
q4 and q5 take only weights that are exactly that, such as a GGUF's Q4_K and Q5_0.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from tollway.model.host_memory import HugePageArena
from tollway.model.native.build import compiled_library
from tollway.checkpoint import cache_root

_log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
_SOURCE = _HERE / "qmatmul.c"
_HEADERS = (_HERE / "qmatmul_tile256.h", _HERE / "qmatmul_pruned_argmax.h")
# No -march=native: each kernel carries its own target attribute, so the lower paths stay what
# they claim to be. No FMA contraction: the float sums are written out, the same in every path.
_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off"]
ISAS = ("portable", "avx2", "avxvnni", "avx512vnni")  # in the order of qmatmul.c's enum isa
KINDS = ("q8", "q4", "q5")  # the weight formats
Q5_COPIES = ("q8", "signed")  # the layouts of q5's copy, in the order of qmatmul.c's Q5_COPY_*
BLOCK = 32  # K values per scale
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
        self._q4_packed_bytes = _bind(lib.q4_packed_bytes, i64, i64, i64)
        self._q4_fit = _bind(lib.q4_fit, i32, p, i64, i64, p, p, p)
        self._q4_pack = _bind(lib.q4_pack, None, p, p, p, i64, i64, p)
        self._q5_packed_bytes = _bind(lib.q5_packed_bytes, i64, i64, i64, i32)
        self._q5_fit = _bind(lib.q5_fit, i32, p, i64, i64, p, p)
        self._q5_pack = _bind(lib.q5_pack, None, p, p, i64, i64, p, i32)
        self._q5_streamed_bytes = _bind(lib.q5_streamed_bytes, i64, p, i64, i64, i64, i32)
        self._kernels = {kind: (_bind(getattr(lib, f"{kind}_matmul"), i32, p, i64, i64, i64, p, i64, p, i64, i32, i32),
                                _bind(getattr(lib, f"{kind}_matmul_argmax"), i32, p, i64, i64, i64, p, i64, p, i32, i32))
                         for kind in KINDS}  # (matmul, argmax) per weight format
        self._pack_pruning = _bind(lib.q8_pack_pruning, i32, p, i64, i64, p, p, p)
        self._signed_bytes = _bind(lib.signed_packed_bytes, i64, i64, i64)
        self._column_bytes = _bind(lib.q8_column_bytes, i64, i64)
        self._reach_floats = _bind(lib.q8_reach_floats, i64, i64, i64)
        self._argmax_pruned = _bind(lib.q8_matmul_argmax_pruned, i64, p, i64, i64, i64, p, p, p, p, i64, p, i32, i32)
        self._peak = _bind(lib.q8_peak, i64, i32, i64, i32)
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
        # The layout of q5's copy for many rows: signed tiles where AVX2 runs them (as it does the
        # coarse copy) faster than q8's layout, which the VNNI paths run best.
        self.q5_copy = "signed" if self.prunes_argmax else "q8"

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

    def pack_q4(self, weight: torch.Tensor, arena: HugePageArena | None = None) -> PackedWeight | None:
        """weight: [N, K] as q4 when every block of 32 is exactly 4-bit (see fit_q4), else None:
        q4 never changes a weight. ValueError when K is not a multiple of 32."""
        parts = self.fit_q4(weight)
        return self.pack_q4_blocks(*parts, arena=arena) if parts is not None else None

    def fit_q4(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q, scale, min) with float32(float32(scale * q) - min) == weight per block of 32, as GGUF's
        Q4_K dequantizes, or None when a block is not 4-bit (or not finite)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
        w = weight.float().contiguous()
        q = torch.empty(n, k, dtype=torch.uint8)
        scale, min = torch.empty(n, k // BLOCK), torch.empty(n, k // BLOCK)
        if self._q4_fit(w.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), min.data_ptr()):
            return None
        return q, scale, min

    def pack_q4_blocks(self, q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor,
                       arena: HugePageArena | None = None) -> PackedWeight:
        """q4 from its parts, w = scale * q - min: q [N, K] uint8 in 0..15, scale and min [N, K / 32] float32."""
        n, k = q.shape
        q, scale, min = q.contiguous(), scale.float().contiguous(), min.float().contiguous()
        data = _empty(self._q4_packed_bytes(n, k), arena)
        self._q4_pack(q.data_ptr(), scale.data_ptr(), min.data_ptr(), n, k, data.data_ptr())
        return PackedWeight(self, "q4", data, n, k)

    def pack_q5(self, weight: torch.Tensor, arena: HugePageArena | None = None,
                copy: str | None = None) -> PackedWeight | None:
        """weight: [N, K] as q5 when every block of 32 is exactly d * (q - 16) with an fp16 d and q in
        0..31 (see fit_q5), else None: q5 never changes a weight. ValueError when K is not a
        multiple of 32. `copy`: as pack_q5_blocks."""
        parts = self.fit_q5(weight)
        return self.pack_q5_blocks(*parts, arena=arena, copy=copy) if parts is not None else None

    def fit_q5(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, d) with float32(d * (q - 16)) == weight, q [N, K] uint8 in 0..31 and d [N, K / 32] float16,
        as GGUF's Q5_0 dequantizes; or None when a block is not so (or not finite)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
        w = weight.float().contiguous()
        q, d = torch.empty(n, k, dtype=torch.uint8), torch.empty(n, k // BLOCK, dtype=torch.float16)
        if self._q5_fit(w.data_ptr(), n, k, q.data_ptr(), d.data_ptr()):
            return None
        return q, d

    def pack_q5_blocks(self, q: torch.Tensor, d: torch.Tensor, arena: HugePageArena | None = None,
                       copy: str | None = None) -> PackedWeight:
        """q5 from its parts, w = d * (q - 16): q [N, K] uint8 in 0..31, d [N, K / 32] float16. The packing
        carries a copy for calls of more than a few rows (see qmatmul.c), in q8's layout or in signed
        tiles (`copy`, self.q5_copy when None); every path runs either, to the same bits."""
        n, k = q.shape
        q, d = q.contiguous(), d.to(torch.float16).contiguous()
        layout = Q5_COPIES.index(copy or self.q5_copy)
        data = _empty(self._q5_packed_bytes(n, k, layout), arena)
        self._q5_pack(q.data_ptr(), d.data_ptr(), n, k, data.data_ptr(), layout)
        return PackedWeight(self, "q5", data, n, k)

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

    def streamed_bytes(self, weight: PackedWeight, rows: int, isa: str | None = None) -> int:
        """What a call of `rows` rows reads of `weight`'s packing: all of it, but for q5, its q5 tiles
        or its copy."""
        if weight.kind == "q5":
            return self._q5_streamed_bytes(weight.data.data_ptr(), rows, weight.out_features, weight.in_features,
                                           self._isa_index(isa))
        return weight.data.numel()

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


class PackedWeight:
    """One weight matrix packed as `kind`, one of KINDS (see qmatmul.c for the layouts)."""

    def __init__(self, library: Q8Library, kind: str, data: torch.Tensor, out_features: int, in_features: int):
        self.library, self.kind, self.data = library, kind, data
        self.out_features, self.in_features = out_features, in_features
        self.pruning: Pruning | None = None  # see Q8Library.add_pruning

    def __call__(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        return self.library.matmul(x, self, isa)

    def argmax(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        return self.library.argmax(x, self, isa)

    def prunes(self, rows: int) -> bool:
        """Whether argmax at `rows` rows takes the pruned way, or counts down a pause of it: else it
        is the kind's plain argmax kernel alone."""
        return self.pruning is not None and rows >= PRUNED_ARGMAX_ROWS

    def streamed_bytes(self, rows: int, isa: str | None = None) -> int:
        return self.library.streamed_bytes(self, rows, isa)


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
    if os.environ.get("TOLLWAY_NATIVE", "1") == "0":
        return None
    lib = compiled_library(_SOURCE, cache_root(cache_dir) / "native", _FLAGS, _HEADERS,
                           fallback="torch fp32 for the q8 kernel")
    return Q8Library(ctypes.CDLL(str(lib))) if lib else None
