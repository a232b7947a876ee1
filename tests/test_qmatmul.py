"""The native integer matmul: every instruction-set path this CPU runs against a float
reference of the same quantization, the same bits from every path, a row's bits independent of
the rows beside it and of the thread count, and the fallbacks."""
from __future__ import annotations

import ctypes
import logging
import shutil

import numpy as np
import pytest
import torch

from tollway.model.layers import Linear
from tollway.model.native import qmatmul
from tollway.model.native.build import compiled_library
from tollway.model.native.qmatmul import ISAS, Q8Library, q8_library

from quantized_rows import check_fused_argmax

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

# (M, K, N): K = 640 is not a multiple of 256 and 2048 is; N past a multiple of 16 leaves a partial tile.
SHAPES = [(1, 640, 17), (3, 640, 1024), (17, 2048, 640), (64, 640, 300), (9, 32, 16), (11, 96, 33)]


def _quantized(t: torch.Tensor, half_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What qmatmul.c makes of t's rows: int values and a scale per block of 32 (fp16 for
    weights, fp32 for activations)."""
    blocks = t.view(t.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    if half_scales:
        scale = (amax / 127).half().float()
        inv = torch.where(scale > 0, 1 / scale, 0.0)
    else:
        scale, inv = amax / 127, torch.where(amax > 0, 127 / amax, 0.0)
    return torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127), scale


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The quantized product in float64: exact integer block sums, scaled, summed."""
    qx, sx = _quantized(x, half_scales=False)
    qw, sw = _quantized(w, half_scales=True)
    sums = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double())
    return (sums * sx.double().unsqueeze(1) * sw.double().unsqueeze(0)).sum(-1)


def _inputs(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :32] *= 50  # an outlier block, as in real activations
    w = torch.randn(n, k, generator=g) * 0.05
    w[n // 2] = 0.0  # an all-zero row: zero scales
    return x, w


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_path_matches_the_quantized_reference(native_library, isa, m, k, n):
    if isa not in native_library.supported:
        pytest.skip(f"this CPU does not run {isa}")
    x, w = _inputs(m, k, n)
    y = native_library.pack(w)(x, isa)
    ref = _reference(x, w)
    assert y.shape == (m, n)
    # Only the float sum over K / 32 blocks rounds: float32 accuracy, relative to the row's scale.
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # And the quantization itself stays within about 1% of the float product.
    exact = x.double() @ w.double().T
    assert float((y - exact).abs().max()) < 0.02 * float(exact.abs().max())


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_all_paths_give_the_same_bits(native_library, m, k, n):
    x, w = _inputs(m, k, n, seed=1)
    packed = native_library.pack(w)
    results = {isa: packed(x, isa) for isa in native_library.supported}
    assert len(results) >= 2  # at least portable and the one compiled for this machine's best
    for isa, y in results.items():
        assert torch.equal(y, results["portable"]), isa


def test_activations_at_the_edges_quantize_alike_on_every_path(native_library):
    """Each path quantizes activations its own way (a C body, AVX2 and AVX-512 by hand): through an
    identity weight every output shows one quantized value, so ties at one half (to even), zero
    blocks, subnormals, huge values, infinities and NaN must come out the same from every path."""
    k = 128
    x = torch.zeros(6, k)
    x[0, :32] = torch.arange(32) - 15.5
    x[0, 0] = 127.0  # the block's scale is then 1, and every other value lies on a half
    x[1, :32] = torch.linspace(-3, 3, 32) * 1e-40  # subnormal
    x[1, 32:64] = torch.linspace(-1, 1, 32) * 3e38  # near float's largest
    x[2] = torch.randn(k)  # block 2 of row 2 stays random; its other blocks below
    x[2, 64:96] = 0.0
    x[3, 5], x[3, 40] = float("inf"), 1.0
    x[4, 7], x[4, 70] = float("nan"), 1.0
    x[5] = torch.randn(k) * 1e-3
    packed = native_library.pack(torch.eye(k))
    results = {isa: packed(x, isa) for isa in native_library.supported}
    for isa, y in results.items():
        torch.testing.assert_close(y, results["portable"], rtol=0, atol=0, equal_nan=True, msg=isa)
    y = results["portable"]
    assert torch.equal(y[0, 1:32], torch.round(x[0, 1:32]))  # halves to even: -15.5 -> -16, -14.5 -> -14
    assert torch.isfinite(y[[0, 1, 2, 5]]).all() and torch.equal(y[2, 64:96], torch.zeros(32))


def _small_value_weights(n: int, k: int, full_range_rows: slice, seed: int) -> torch.Tensor:
    """A GGUF Q5_0 weight as it dequantizes, d * (q - 16) with q in 0..31 and an fp16 d per block of
    32 (each block holding a q of 0, so q8 packs it exactly with |values| <= 16), except the rows in
    `full_range_rows`, which are plain floats."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (n, k), generator=g)
    q[:, ::32] = 0
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    w = (q - 16).float() * d.repeat_interleave(32, dim=1)
    w[full_range_rows] = torch.randn(w[full_range_rows].shape, generator=g) * 0.05
    return w


@pytest.mark.parametrize("m,n", [(1, 40), (5, 300), (64, 64), (13, 1000)])
def test_tiles_of_small_values_give_the_same_bits_on_every_path(native_library, m, n):
    """AVX2 takes a tile whose values all lie within +-16 another way (tile_avx2_small): the tiles
    packed so, and those beside them that are not, give every path's bits."""
    k = 640
    w = _small_value_weights(n, k, slice(16, 32), seed=6)  # the second tile is full range
    x = _inputs(m, k, n, seed=7)[0]
    packed = native_library.pack(w)
    tiles = -(-n // 16)
    largest = packed.data[tiles * (k // 32) * (16 * 32 + 16 * 2):]
    assert largest.numel() == tiles
    expected = [127 if t == 1 else 16 for t in range(tiles)]  # each block's 127 steps, or its q = 0 at 16
    assert largest.tolist() == expected
    results = {isa: packed(x, isa) for isa in native_library.supported}
    for isa, y in results.items():
        assert torch.equal(y, results["portable"]), isa
        assert torch.equal(packed.argmax(x, isa), y.argmax(dim=1)), isa
    exact = x.double() @ w.double().T
    assert float((results["portable"] - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_a_row_is_the_same_alone_in_a_batch_and_with_any_thread_count(native_library):
    x, w = _inputs(64, 640, 1000, seed=2)
    packed = native_library.pack(w)
    batch = packed(x)
    for i in (0, 5, 63):
        assert torch.equal(packed(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(packed(x[3:20]), batch[3:20])  # odd counts, off the 8-row grid
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(packed(x), batch)
        torch.set_num_threads(1)
        assert torch.equal(packed(x), batch)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_are_read_in_place(native_library):
    x, w = _inputs(6, 640, 48, seed=3)
    wide = torch.cat([x, torch.randn(6, 64)], dim=1)[:, :640]  # row stride 704
    packed = native_library.pack(w)
    assert torch.equal(packed(wide), packed(x))


def test_a_lower_path_is_forced_by_env_or_argument(native_library, monkeypatch):
    x, w = _inputs(4, 64, 32)
    monkeypatch.setenv("TOLLWAY_ISA", "portable")
    forced = Q8Library(native_library._lib)
    assert forced.isa == "portable" and native_library.isa == native_library.supported[-1]
    assert forced.forced == ("portable" if len(native_library.supported) > 1 else None) and native_library.forced is None
    assert torch.equal(forced.pack(w)(x), native_library.pack(w)(x, "portable"))
    # A step profile is remembered under `build`: one timed on the highest path models no other.
    assert forced.build.endswith("-portable") and native_library.build != forced.build
    monkeypatch.setenv("TOLLWAY_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        Q8Library(native_library._lib)
    with pytest.raises(ValueError, match="sse9"):
        native_library.pack(w)(x, "sse9")


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(q8_library().supported if q8_library() else []),
                    reason="needs a CPU with AVX512-VNNI")
def test_the_dot_peak_is_that_of_the_path_the_kernels_run(native_library, monkeypatch):
    # 64 multiply-adds an instruction against AVX2's 32 a pair of them: the AVX2 loop's peak is
    # about a quarter of VNNI's; a forced AVX2 run measured against VNNI's looked half as fast.
    monkeypatch.setenv("TOLLWAY_ISA", "avx2")
    avx2 = Q8Library(native_library._lib).dot_peak(200_000)
    assert avx2 < 0.7 * native_library.dot_peak(200_000)


def test_the_read_peak_reads_every_word_of_its_buffer(native_library):
    words = torch.randint(-2**62, 2**62, (8 * 1000 + 5,), dtype=torch.int64)  # a tail past the threads' shares
    expected = int(np.bitwise_xor.reduce(words.numpy().view(np.uint64)))
    for threads in (1, 2, 3):
        assert native_library._read(words.data_ptr(), words.numel() * 8, threads) == expected
    assert native_library.read_peak(words, repeats=2) > 0


def test_linear_runs_q8_natively_and_falls_back_on_shapes_it_does_not_cover(native_library, caplog):
    g = torch.Generator().manual_seed(4)
    w, bias, x = torch.randn(40, 64, generator=g), torch.randn(40, generator=g), torch.randn(3, 64, generator=g)
    native = Linear(w, bias, {"q8"}, torch.device("cpu"), q8=native_library)
    assert native.native is not None and native.fp32 is None
    assert torch.equal(native(x, "q8"), native_library.pack(w)(x) + bias)
    with caplog.at_level(logging.WARNING):
        odd = Linear(w[:, :40], None, {"q8"}, torch.device("cpu"), q8=native_library)
    assert odd.native is None and "not a multiple of 32" in caplog.text
    assert torch.equal(odd(x[:, :40], "q8"), Linear(w[:, :40], None, {"fp32"}, torch.device("cpu"))(x[:, :40], "fp32"))
    with pytest.raises(ValueError, match="multiple of 32"):
        native_library.pack(w[:, :40])
    huge = w.clone()
    huge[3, 7] = 1e7  # its block's scale would pass fp16's largest
    with caplog.at_level(logging.WARNING):
        beyond = Linear(huge, None, {"q8"}, torch.device("cpu"), q8=native_library)
    assert beyond.native is None and "fp16" in caplog.text
    assert torch.equal(beyond(x, "q8"), Linear(huge, None, {"fp32"}, torch.device("cpu"))(x, "fp32"))


def test_without_a_compiler_q8_runs_on_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    qmatmul.q8_library.cache_clear()
    try:
        assert q8_library(tmp_path) is None
    finally:
        qmatmul.q8_library.cache_clear()
    assert "qmatmul.c" in caplog.text and "torch" in caplog.text


@pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")
def test_a_library_of_several_sources_links_and_a_failing_one_is_named(tmp_path, caplog):
    """As the integer matmul's sources are built: an object each, side by side, then one library."""
    (tmp_path / "one.c").write_text("int one(void) { return 1; }\n")
    (tmp_path / "two.c").write_text("int one(void);\nint two(void) { return one() + 1; }\n")
    (tmp_path / "bad.c").write_text("int three(void) { return no_such_name; }\n")
    flags, out = ["-O2", "-shared", "-fPIC"], tmp_path / "out"
    lib = compiled_library((tmp_path / "one.c", tmp_path / "two.c"), out, flags)
    assert lib.name.startswith("one-") and ctypes.CDLL(str(lib)).two() == 2
    with caplog.at_level(logging.WARNING):
        assert compiled_library((tmp_path / "one.c", tmp_path / "bad.c"), out, flags, fallback="torch") is None
    assert "compiling one.c failed" in caplog.text and "no_such_name" in caplog.text
    assert [p.name for p in out.iterdir()] == [lib.name]  # no object or half-built library left behind


@pytest.mark.parametrize("m", [1, 3, 17])
def test_the_fused_argmax_is_the_argmax_of_the_outputs_ties_going_to_the_first(native_library, m):
    x, w = _inputs(m, 640, 5000, seed=5)
    w[4000] = w[17] = w[4999] = w[3000] * 1.0  # identical rows give tied outputs
    x[0] = w[3000] * 10  # row 0's largest output is then that four-way tie
    check_fused_argmax(native_library, native_library.pack(w), x)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_the_fused_argmax_takes_the_first_of_ties_in_one_lane_and_never_a_padding_column(native_library, m):
    """Every output negative, so a padding column's 0 would win if it counted (1000 columns: the last
    tile holds 8); the best is a tie of columns 17, 33 and 49, one lane of three tiles in a row."""
    g = torch.Generator().manual_seed(m)
    w = torch.rand(1000, 64, generator=g) + 0.5
    w[17] = w[33] = w[49] = w[17] * 0.01
    x = -(torch.rand(m, 64, generator=g) + 0.5)
    packed = native_library.pack(w)
    expected = packed(x).argmax(dim=1)
    assert (expected == 17).all() and (packed(x) < 0).all()
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for isa in native_library.supported:
                assert torch.equal(packed.argmax(x, isa), expected), (count, isa)
    finally:
        torch.set_num_threads(threads)


def test_without_any_compiler_the_native_kernels_say_so_once(tmp_path, monkeypatch, caplog):
    from tollway.model.native import build
    from tollway.model.row_ops import row_ops_library

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    build._warn_no_compiler.cache_clear()
    qmatmul.q8_library.cache_clear()
    try:
        assert q8_library(tmp_path) is None and row_ops_library(tmp_path) is None
    finally:
        qmatmul.q8_library.cache_clear()
        build._warn_no_compiler.cache_clear()
    assert caplog.text.count("no C compiler found") == 1
