"""The native q5 matmul: weights that are exactly 5-bit per block of 32 (w = d * (q - 16) with an
fp16 d, as a GGUF's Q5_0 dequantizes) on every instruction-set path against an exact float64
model, the same bits from every path and from q8 where q8 packs the blocks exactly, a row's bits
independent of the rows beside it (a call of many rows runs on the packing's copy, in q8's layout
or in signed tiles, each tested on every path), the repacking lossless, and everything else left
to the other formats."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tollway.model.layers import Linear
from tollway.model.native.qmatmul import ISAS, Q5_COPIES

from quantized_rows import check_fused_argmax, check_path_against_model, quantized_rows

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

# (M, K, N): K = 640 is not a multiple of 256 and 2048 is; N past a multiple of 16 leaves a partial
# tile; M of 1 to 4 runs on the q5 tiles, more on their copy.
SHAPES = [(1, 640, 17), (2, 2048, 40), (4, 640, 300), (5, 640, 300), (17, 2048, 640), (64, 640, 300), (9, 32, 16),
          (3, 96, 33)]


def _q5_parts(n: int, k: int, seed: int = 0):
    """Random 5-bit blocks as Q5_0 makes them: q [n, k] in 0..31 with a 0 in every block, d [n, k / 32]
    an fp16 of either sign (Q5_0's d takes the sign of the block's value of largest magnitude)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    q[:, ::32] = 0
    d = (torch.rand(n, k // 32, generator=g) * 1e-2 + 1e-4) * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1, 1)
    d = d.half()
    d[n // 2] = 0.0  # rows of zeros
    return q, d


def _dequantized(q, d) -> torch.Tensor:
    n, k = q.shape
    return ((q.view(n, -1, 32).float() - 16) * d.float().unsqueeze(-1)).view(n, k)


def _inputs(m, k, n, seed=0):
    q, d = _q5_parts(n, k, seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :32] *= 50  # an outlier block, as in real activations
    return x, _dequantized(q, d), (q, d)


def _model(x: torch.Tensor, q, d) -> tuple[torch.Tensor, torch.Tensor]:
    """The q5 product in float64, and the size of its terms (float32 rounds each of them): x in int8
    per block of 32 with a float32 scale, exact integer block sums."""
    qx, xs = quantized_rows(x)
    sums = torch.einsum("mbi,nbi->mnb", qx, q.view(q.shape[0], -1, 32).double() - 16) * d.double()
    return (sums * xs.unsqueeze(1)).sum(-1), (sums.abs() * xs.unsqueeze(1)).sum(-1)


@pytest.mark.parametrize("copy", Q5_COPIES)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_path_matches_the_float64_model(native_library, copy, isa, m, k, n):
    x, w, parts = _inputs(m, k, n)
    check_path_against_model(native_library, isa, "q5", x, w, _model(x, *parts), copy=copy)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_all_paths_give_the_same_bits_as_each_other_and_as_q8(native_library, m, k, n):
    """Each block holds a q of 0, so q8 packs it exactly (d's magnitude, values q - 16 or their
    negation): the same integer sums and scales, so the same bits."""
    x, w, _ = _inputs(m, k, n, seed=1)
    results = {(copy, isa): native_library.pack_q5(w, copy=copy)(x, isa)
               for copy in Q5_COPIES for isa in native_library.supported}
    q8 = native_library.pack(w)
    for (copy, isa), y in results.items():
        assert torch.equal(y, results["q8", "portable"]), (copy, isa)
        assert torch.equal(y, q8(x, isa)), (copy, isa)


@pytest.mark.parametrize("copy", Q5_COPIES)
def test_a_row_is_the_same_alone_in_a_batch_and_with_any_thread_count(native_library, copy):
    """One row runs on the q5 tiles, 64 on their copy: the same bits either way."""
    x, w, _ = _inputs(64, 640, 1000, seed=2)
    packed = native_library.pack_q5(w, copy=copy)
    batch = packed(x)
    for isa in native_library.supported:
        for i in (0, 5, 63):
            assert torch.equal(packed(x[i:i + 1], isa), batch[i:i + 1]), isa
        assert torch.equal(packed(x[3:7], isa), batch[3:7]), isa
    threads = torch.get_num_threads()
    try:
        for count in (3, 1):
            torch.set_num_threads(count)
            assert torch.equal(packed(x), batch)
            assert torch.equal(packed(x[:2]), batch[:2])
    finally:
        torch.set_num_threads(threads)


def test_a_call_of_few_rows_reads_the_5_bit_tiles_and_of_many_the_copy(native_library):
    _, w, _ = _inputs(1, 640, 1024, seed=3)
    q8 = native_library.pack(w)
    signed_bytes = 1024 * 640 // 32 * (32 + 4 + 2)  # a byte a value, an int32 offset and an fp16 scale a block
    for copy, copy_bytes in (("q8", q8.data.numel()), ("signed", signed_bytes)):
        packed = native_library.pack_q5(w, copy=copy)
        assert packed.streamed_bytes(1) == 1024 * 640 * 22 // 32  # Q5_0's own 5.5 bits a weight
        assert packed.streamed_bytes(64) == copy_bytes, copy
        assert packed.data.numel() == packed.streamed_bytes(1) + 64 + copy_bytes, copy  # and the copy's layout byte


def _q5_0_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """GGUF Q5_0 data from gguf's own quantizer (llama.cpp's rule: d = the value of largest magnitude
    over -16, so d takes its sign), [rows, k / 32 * 22] bytes."""
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, GGMLQuantizationType.Q5_0)


def test_q5_0_weights_repack_losslessly(native_library):
    w = torch.from_numpy(dequantize(_q5_0_blocks(48, 512, seed=4), GGMLQuantizationType.Q5_0).copy())
    parts = native_library.fit_q5(w)
    assert parts is not None
    q, d = parts
    assert torch.equal(_dequantized(q, d), w)  # bit for bit
    assert (d < 0).any() and (d > 0).any()
    x = torch.randn(5, 512)
    ref, size = _model(x, q, d)
    for m in (1, 5):  # the q5 tiles and the copy
        assert ((native_library.pack_q5(w)(x[:m]).double() - ref[:m]).abs() <= 1e-6 * size[:m] + 1e-30).all()


def test_the_default_models_q5_0_tensors_pack_as_q5(native_library, default_weights):
    """The default GGUF's Q5_0 tensors (q_proj, gate and up) pack as q5, its Q8_0 ones as q8, and a
    fused q/k/v with a Q8_0 part as q8: q5 takes a whole tensor or none of it."""
    t = default_weights.tensors
    q_proj, v_proj = t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.v_proj.weight"]
    assert Linear(q_proj, None, {"q8"}, torch.device("cpu"), q8=native_library).native.kind == "q5"
    assert Linear(v_proj, None, {"q8"}, torch.device("cpu"), q8=native_library).native.kind == "q8"
    fused = Linear(torch.cat([q_proj, v_proj]), None, {"q8"}, torch.device("cpu"), q8=native_library)
    assert fused.native.kind == "q8"


def test_weights_that_are_not_5bit_stay_on_q8(native_library):
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 64, generator=g), torch.randn(3, 64, generator=g)
    assert native_library.pack_q5(w) is None
    q, d = _q5_parts(40, 64)
    for bad in (float("nan"), float("inf")):
        exact = _dequantized(q, d)
        exact[5, 9] = bad
        assert native_library.fit_q5(exact) is None
    nearly = _dequantized(q, d)
    nearly[7, 3] = nearly[7, 3] * 1.001 + 1e-6  # one value off the block's grid
    assert native_library.fit_q5(nearly) is None
    off_grid = Linear(nearly, None, {"q8"}, torch.device("cpu"), q8=native_library)
    assert off_grid.native.kind == "q8" and torch.equal(off_grid(x, "q8"), native_library.pack(nearly)(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        native_library.pack_q5(w[:, :40])


@pytest.mark.parametrize("copy", Q5_COPIES)
@pytest.mark.parametrize("m", [1, 4, 17])
def test_the_fused_argmax_is_the_argmax_of_the_outputs_ties_going_to_the_first(native_library, m, copy):
    x, w, _ = _inputs(m, 640, 5000, seed=6)
    w[4000] = w[17] = w[4999] = w[3000]  # identical rows give tied outputs
    x[0] = w[3000] * 10
    check_fused_argmax(native_library, native_library.pack_q5(w, copy=copy), x)
