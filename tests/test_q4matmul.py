"""The native q4 matmul: weights that are exactly 4-bit per block of 32 (w = scale * q - min, as a
GGUF's Q4_K dequantizes) on every instruction-set path against an exact float64 model, the same
bits from every path, a row's bits independent of the rows beside it and of the thread count, the
repacking lossless, and everything else left to int8 blocks (exact for GGUF's symmetric formats)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tollway.model.layers import Linear
from tollway.model.native.qmatmul import ISAS

from quantized_rows import check_fused_argmax, check_path_against_model, quantized_rows

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

# (M, K, N): K = 640 is not a multiple of 256 and 2048 is; N past a multiple of 16 leaves a partial tile.
SHAPES = [(1, 640, 17), (3, 2048, 40), (17, 2048, 640), (64, 640, 300), (9, 32, 16), (11, 96, 33)]


def _q4_parts(n: int, k: int, seed: int = 0):
    """Random 4-bit blocks as Q4_K makes them: q [n, k] in 0..15 with a 0 in every block, scale and
    min [n, k / 32] an fp16 times a 6-bit integer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q[:, ::32] = 0
    def fp16_times_6_bits():
        return (torch.rand(n, k // 32, generator=g) * 1e-3).half().float() * torch.randint(0, 64, (n, k // 32), generator=g)
    scale, min = fp16_times_6_bits(), fp16_times_6_bits()
    scale[n // 2] = 0.0  # constant rows
    return q, scale, min


def _dequantized(q, scale, min) -> torch.Tensor:
    n, k = q.shape
    return (scale.unsqueeze(-1) * q.view(n, -1, 32).float() - min.unsqueeze(-1)).view(n, k)


def _inputs(m, k, n, seed=0):
    q, scale, min = _q4_parts(n, k, seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :32] *= 50  # an outlier block, as in real activations
    return x, _dequantized(q, scale, min), (q, scale, min)


def _model(x: torch.Tensor, q, scale, min) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 product in float64, and the size of its terms (float32 rounds each of them): x in
    int8 per block of 32 with a float32 scale, exact integer block sums."""
    qx, xs = quantized_rows(x)
    sums = torch.einsum("mbi,nbi->mnb", qx, q.view(q.shape[0], -1, 32).double())
    scaled, offset = sums * scale.double(), min.double() * qx.sum(-1).unsqueeze(1)
    terms = xs.unsqueeze(1) * (scaled.abs() + offset.abs())
    return ((scaled - offset) * xs.unsqueeze(1)).sum(-1), terms.sum(-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_path_matches_the_float64_model(native_library, isa, m, k, n):
    x, w, parts = _inputs(m, k, n)
    check_path_against_model(native_library, isa, "q4", x, w, _model(x, *parts))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_all_paths_give_the_same_bits(native_library, m, k, n):
    x, w, _ = _inputs(m, k, n, seed=1)
    packed = native_library.pack_q4(w)
    results = {isa: packed(x, isa) for isa in native_library.supported}
    for isa, y in results.items():
        assert torch.equal(y, results["portable"]), isa


def test_a_row_is_the_same_alone_in_a_batch_and_with_any_thread_count(native_library):
    x, w, _ = _inputs(64, 640, 1000, seed=2)
    packed = native_library.pack_q4(w)
    batch = packed(x)
    for i in (0, 5, 63):
        assert torch.equal(packed(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(packed(x[3:20]), batch[3:20])
    threads = torch.get_num_threads()
    try:
        for count in (3, 1):
            torch.set_num_threads(count)
            assert torch.equal(packed(x), batch)
    finally:
        torch.set_num_threads(threads)


def _q4_k_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF Q4_K data, [rows, k / 256 * 144] bytes: fp16 d and dmin, 12 bytes of 6-bit
    scales and mins, 128 bytes of nibbles; each sub-block of 32 has a q of 0, as quantizing gives."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.stack([rng.uniform(1e-4, 1e-2, len(blocks)), rng.uniform(1e-4, 1e-2, len(blocks))],
                              axis=1).astype(np.float16).view(np.uint8)
    nibbles = blocks[:, 16:].reshape(-1, 4, 32)  # 4 x 32 bytes: sub-blocks 2j (low) and 2j + 1 (high)
    nibbles[:, :, 5] = 0
    return blocks.reshape(rows, -1)


def test_q4_k_weights_repack_losslessly(native_library):
    w = torch.from_numpy(dequantize(_q4_k_blocks(48, 512, seed=3), GGMLQuantizationType.Q4_K).copy())
    parts = native_library.fit_q4(w)
    assert parts is not None
    assert torch.equal(_dequantized(*parts), w)  # bit for bit
    x = torch.randn(5, 512)
    ref, size = _model(x, *parts)
    assert ((native_library.pack_q4(w)(x).double() - ref).abs() <= 1e-6 * size + 1e-30).all()


def test_the_default_models_tensors_pack_exactly_as_their_gguf_blocks(native_library, default_weights):
    """q8 packs a Q4_K tensor as 4-bit, a Q5_0 one as 5-bit and a Q8_0 one as int8 blocks, each holding
    the file's own values: each product is then the exact sum over the GGUF's weights of the quantized
    activations."""
    t = default_weights.tensors
    q4_k = t["model.layers.0.self_attn.o_proj.weight"]  # Q4_K in the default GGUF
    q5_0 = t["model.layers.0.self_attn.q_proj.weight"]
    q8_0 = t["model.layers.0.self_attn.v_proj.weight"]
    on_q4 = Linear(q4_k, None, {"q8"}, torch.device("cpu"), q8=native_library)
    assert on_q4.native.kind == "q4" and on_q4.fp32 is None
    x = torch.randn(3, 1024)
    assert torch.equal(on_q4(x, "q8"), native_library.pack_q4(q4_k)(x))
    x = torch.randn(3, 640)
    qx, sx = quantized_rows(x)
    for w, kind in ((q5_0, "q5"), (q8_0, "q8")):
        on_q8 = Linear(w, None, {"q8"}, torch.device("cpu"), q8=native_library)
        assert on_q8.native.kind == kind
        exact = torch.einsum("mbi,nbi->mnb", qx * sx.unsqueeze(-1), w.double().view(w.shape[0], -1, 32)).sum(-1)
        assert torch.allclose(on_q8(x, "q8").double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    # A weight on no GGUF grid is rounded to int8 blocks: the same product no longer holds exactly.
    rounded = q5_0 + 1e-4 * torch.randn_like(q5_0)
    exact = torch.einsum("mbi,nbi->mnb", qx * sx.unsqueeze(-1), rounded.double().view(rounded.shape[0], -1, 32)).sum(-1)
    off = Linear(rounded, None, {"q8"}, torch.device("cpu"), q8=native_library)(x, "q8").double()
    assert not torch.allclose(off, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


def test_weights_that_are_not_4bit_stay_on_q8_and_without_the_library_on_fp32(native_library):
    g = torch.Generator().manual_seed(4)
    w, bias, x = torch.randn(40, 64, generator=g), torch.randn(40, generator=g), torch.randn(3, 64, generator=g)
    assert native_library.pack_q4(w) is None
    _, scale, min = _q4_parts(40, 64)
    for bad in (float("nan"), float("inf")):
        exact = _dequantized(torch.zeros(40, 64, dtype=torch.uint8), scale, min)
        exact[5, 9] = bad
        assert native_library.fit_q4(exact) is None
    mixed = Linear(w, bias, {"q8"}, torch.device("cpu"), q8=native_library)
    assert mixed.native.kind == "q8" and torch.equal(mixed(x, "q8"), native_library.pack(w)(x) + bias)
    with pytest.raises(ValueError, match="multiple of 32"):
        native_library.pack_q4(w[:, :40])
    on_torch = Linear(w, bias, {"q8"}, torch.device("cpu"))
    assert torch.equal(on_torch(x, "q8"), Linear(w, bias, {"fp32"}, torch.device("cpu"))(x, "fp32"))


@pytest.mark.parametrize("m", [1, 17])
def test_the_fused_argmax_is_the_argmax_of_the_outputs_ties_going_to_the_first(native_library, m):
    x, w, _ = _inputs(m, 640, 5000, seed=5)
    w[4000] = w[17] = w[4999] = w[3000]  # identical rows give tied outputs
    x[0] = w[3000] * 10
    check_fused_argmax(native_library, native_library.pack_q4(w), x)
