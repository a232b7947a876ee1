"""The native matmuls on GGUF tensors packed as the file holds them (pack_gguf, one format per type
of GGUF_KINDS): random blocks in each type's byte layout against an exact float64 model (gguf-py's
dequantization @ the activations as the kernels quantize them), within float32's rounding of the
sums; the same bits from every instruction-set path and thread count; a row's bits independent of
the rows beside it; the fused argmax; tails of N, M and K; and a corrupted byte caught."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tollway.model.native.qmatmul import GGUF_KINDS

from gguf_blocks import LAYOUTS, POSITIVE_SCALES, random_blocks as _blocks
from quantized_rows import quantized_rows

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

TYPES = list(GGUF_KINDS)

# (M, K, N): N of one column, of a partial tile and of many tiles (and thread ranges); M of one
# kernel pass and more (8 rows a pass); K of one superblock and several.
SHAPES = [(1, 256, 1), (2, 768, 37), (5, 256, 1000), (8, 768, 16), (9, 768, 37), (17, 256, 37), (64, 768, 37)]
# Q8_0, Q5_0 and Q4_0 take any K of whole blocks of 32.
SHAPES_32 = [(3, 640, 37), (7, 96, 1000), (1, 32, 5)]


def _activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :32] *= 50  # an outlier block, as in real activations
    if k > 64:
        x[-1, 32:64] = 0  # a block of zeros: a zero scale
    return x


def _model(gguf_type: str, blocks: np.ndarray, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The product in float64, gguf-py's weights @ x as the kernels quantize it (int8 per block of
    32 times a float32 scale, one per superblock of 256 for the K-quants), and the size of its terms: |x| @ each weight's parts. Q4_K's and
    Q5_K's weights, d * sc * q - dmin * m, are two parts apart (d * sc * q + dmin * m: its dmin negated, d and dmin
    being positive), which the kernels and gguf-py each round in float32."""
    qtype = GGMLQuantizationType[gguf_type]
    m, k = x.shape
    w = dequantize(blocks, qtype).astype(np.float64)
    if gguf_type in POSITIVE_SCALES:
        flipped = blocks.reshape(blocks.shape[0], -1, LAYOUTS[gguf_type][1]).copy()
        flipped[:, :, 3] ^= 0x80  # dmin's sign bit
        parts = dequantize(flipped.reshape(blocks.shape), qtype).astype(np.float64)
    else:
        parts = np.abs(w)
    qx, xs = quantized_rows(x, span=LAYOUTS[gguf_type][0])  # the K-quants' activations: a scale per superblock
    xd = (qx * xs.unsqueeze(-1)).reshape(m, k).numpy()
    return xd @ w.T, np.abs(xd) @ parts.T


def _error_and_bound(y: torch.Tensor, model: tuple[np.ndarray, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """|y - model| and what float32 allows: each block's term rounded a few times (its scale, Q4_K's
    two parts and their difference, gguf-py's weights), then the sum over the K / 32 blocks rounded
    at each step: (K / 32 + 4) x 2^-24 of the terms' sizes."""
    ref, size = model
    error = np.abs(y.double().numpy() - ref)
    return np.where(np.isnan(error), np.inf, error), (k // 32 + 4) * 2.0 ** -24 * size + 1e-30


def _check(y: torch.Tensor, model, k: int) -> None:
    error, bound = _error_and_bound(y, model, k)
    assert y.shape == model[0].shape
    assert (error <= bound).all(), float((error / bound).max())


def _shapes(gguf_type: str):
    return SHAPES + (SHAPES_32 if LAYOUTS[gguf_type][0] == 32 else [])


@pytest.mark.parametrize("gguf_type", TYPES)
def test_every_path_matches_the_model_with_the_same_bits(native_library, gguf_type):
    threads = torch.get_num_threads()
    try:
        for seed, (m, k, n) in enumerate(_shapes(gguf_type)):
            blocks, x = _blocks(gguf_type, n, k, seed), _activations(m, k, seed + 100)
            packed = native_library.pack_gguf(gguf_type, blocks, n, k)
            assert packed.kind == GGUF_KINDS[gguf_type] and packed.out_features == n and packed.in_features == k
            model = _model(gguf_type, blocks, x)
            torch.set_num_threads(1)
            first = None
            for isa in native_library.supported:
                y = packed(x, isa)
                _check(y, model, k)
                first = y if first is None else first
                assert torch.equal(y, first), (isa, m, k, n)
            torch.set_num_threads(2)  # the same bits from threads sharing the tiles
            assert torch.equal(packed(x), first), (m, k, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gguf_type", TYPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(native_library, gguf_type):
    k, n = 1280, 300  # 19 tiles, a partial one last; 64 x 1280 activations are quantized (and summed) by both threads
    blocks, x = _blocks(gguf_type, n, k), _activations(64, k)
    packed = native_library.pack_gguf(gguf_type, blocks, n, k)
    threads = torch.get_num_threads()
    try:
        for isa in native_library.supported:
            torch.set_num_threads(1)
            alone = torch.cat([packed(x[i:i + 1], isa) for i in range(64)])
            torch.set_num_threads(2)
            for m in (*range(1, 10), 17, 64):
                assert torch.equal(packed(x[:m], isa), alone[:m]), (isa, m)
            assert torch.equal(packed(x[5:22], isa), alone[5:22]), isa  # rows at another place in their pass
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gguf_type", TYPES)
def test_argmax_is_the_first_largest_output(native_library, gguf_type):
    k, n, m = 256, 1000, 5
    blocks = _blocks(gguf_type, n, k)
    w = dequantize(blocks, GGMLQuantizationType[gguf_type])
    top = int((w.astype(np.float64) ** 2).sum(1).argmax())  # the longest row moves to 17, 400 and 999:
    blocks[17] = blocks[400] = blocks[999] = blocks[top]  # the same weights, the same bits, a tie
    if top not in (17, 400, 999):
        blocks[top] = blocks[top - 1 if top else 1]
    x = _activations(m, k)
    x[0] = torch.from_numpy(w[top]) * 1e3  # column 17 tops row 0
    packed = native_library.pack_gguf(gguf_type, blocks, n, k)
    y = packed(x)
    expected = y.argmax(dim=1)  # the first of equal largest
    assert int(expected[0]) == 17 and y[0, 17] == y[0, 400] == y[0, 999]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for isa in native_library.supported:
                assert torch.equal(packed.argmax(x, isa), expected), (count, isa)
                assert torch.equal(packed.argmax(x[1:], isa), expected[1:]), (count, isa)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gguf_type", TYPES)
def test_packing_keeps_the_files_width(native_library, gguf_type):
    n, k = 64, 768 if LAYOUTS[gguf_type][0] == 256 else 640
    blocks = _blocks(gguf_type, n, k)
    packed = native_library.pack_gguf(gguf_type, blocks, n, k)
    assert blocks.nbytes <= packed.data.numel() <= 1.03 * blocks.nbytes
    assert packed.streamed_bytes() == packed.data.numel()


@pytest.mark.parametrize("gguf_type", TYPES)
def test_a_corrupted_byte_is_caught(native_library, gguf_type):
    """The checks above can fail: one packed byte changed (a value, a scale, ...) changes outputs on
    every path, past the model's bound."""
    m, k, n = 2, 256, 32  # two full tiles: every byte of them is a value or a scale
    blocks = _blocks(gguf_type, n, k, zero_row=False)
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(m, k, generator=g) + 0.5) * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    packed = native_library.pack_gguf(gguf_type, blocks, n, k)
    model = _model(gguf_type, blocks, x)
    clean = {isa: packed(x, isa) for isa in native_library.supported}
    for isa, y in clean.items():
        _check(y, model, k)
    size = packed.data.numel()
    tile = (size - (2 if packed.kind == "q8" else 0)) // 2  # (q8's tiles are followed by a byte each)
    for at in (0, size // 3, tile - 1, 2 * tile - 1):  # none of x quantizes to 0: every value counts
        original = int(packed.data[at])
        packed.data[at] = original ^ 0x5A
        try:
            for isa in native_library.supported:
                y = packed(x, isa)
                assert not torch.equal(y, clean[isa]), (at, isa)
                error, bound = _error_and_bound(y, model, k)
                assert (error > bound).any(), (at, isa)
        finally:
            packed.data[at] = original


@pytest.mark.parametrize("gguf_type", TYPES)
def test_packing_a_part_at_a_time_gives_the_same_bytes_and_reports_each_part(native_library, gguf_type, monkeypatch):
    from tollway.model.native import qmatmul

    n, k = 1000, 256
    blocks = _blocks(gguf_type, n, k)
    whole = native_library.pack_gguf(gguf_type, blocks, n, k)
    monkeypatch.setattr(qmatmul, "PACK_CHUNK_BYTES", blocks.strides[0] * 16 * 5)  # 5 tiles a part
    done = []
    parts = native_library.pack_gguf(gguf_type, blocks, n, k, packed_rows=lambda start, end: done.append((start, end)))
    assert torch.equal(parts.data, whole.data)
    assert done == [(start, min(n, start + 80)) for start in range(0, n, 80)]
