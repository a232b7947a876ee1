"""The LM head's argmax found on a coarse copy of its weights (qmatmul_pruned_argmax.h): always
the exact argmax's column, on every path, ties going to the first; rows the bounds cannot narrow
run the exact matmul, and a weight whose rows keep doing so stops pruning for a while."""
from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from tollway.model.layers import LinearBuilder
from tollway.model.native.qmatmul import ISAS, PRUNING_PAUSE_CALLS, Q8Library, _bind

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

TIED = (17, 3000, 4000, 4999)  # identical weight rows: their outputs tie


def _head(n: int, k: int, seed: int, coarse: bool = False) -> torch.Tensor:
    """An LM head as a GGUF Q8_0 holds it: int8 values q with their 127 in every block of 32, times an
    fp16 scale d per block that varies across blocks and rows; or its coarse copy, q / 8 rounded
    (127 -> 16) times d * 8 in fp16, which q8 packs exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g)
    q[:, ::32] = 127
    d = (torch.rand(n, k // 32, generator=g) * 0.004 + 0.0005).half().float()
    if coarse:
        q, d = torch.round(q / 8), (d * 8).half().float()
    return q.float() * d.repeat_interleave(32, dim=1)


def _rows(w: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """Hidden states as hard as they come: noise, so that each row's best columns lie close (and
    the coarse copy often orders them otherwise), one with an outlier block, and row 0 tied at TIED."""
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(seed))
    x[m // 2, 64:96] *= 40
    x[0] = w[TIED[1]] * 50
    return x


def _exact(packed, x: torch.Tensor) -> torch.Tensor:
    """The fused argmax without pruning."""
    saved, packed.pruning = packed.pruning, None
    try:
        return packed.argmax(x)
    finally:
        packed.pruning = saved


def _tied(w: torch.Tensor) -> torch.Tensor:
    w[list(TIED)] = w[TIED[1]].clone()
    return w


@pytest.fixture(scope="module")
def head(native_library):
    packed = native_library.pack(_tied(_head(5000, 640, seed=1)))  # 5000 = 312 tiles and a half
    assert native_library.add_pruning(packed)
    return _tied(_head(5000, 640, seed=1)), packed


@pytest.mark.parametrize("m", [4, 13, 64])
def test_the_pruned_argmax_is_the_exact_one_on_every_path(native_library, head, m):
    w, packed = head
    x = _rows(w, m, seed=m)
    expected = packed(x).argmax(dim=1)  # the first column on ties
    assert int(expected[0]) == TIED[0]
    # Rows whose coarse outputs put another column first: the bounds must let the exact one through.
    coarse = native_library.pack(_tied(_head(5000, 640, seed=1, coarse=True))).argmax(x)
    assert (coarse != expected).any() or m < 8
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):  # ties across the threads' column ranges
            torch.set_num_threads(count)
            for isa in native_library.supported:
                tokens, exact_rows = native_library.pruned_argmax(x, packed, isa)
                assert torch.equal(tokens, expected), (count, isa)
                assert exact_rows == 0, (count, isa)  # the bounds settled every row
    finally:
        torch.set_num_threads(threads)


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 per block of 32 with a scale amax / 127, back in float."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, 0.0)).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 13])
def test_the_coarse_kernels_compute_the_coarse_copy(native_library, m):
    """Each path's coarse outputs are the coarse weights times the quantized activations, in the
    same bits on every path (the tail tile included: 1000 columns are 62.5 tiles)."""
    packed = native_library.pack(_head(1000, 640, seed=8))
    assert native_library.add_pruning(packed)
    coarse = _head(1000, 640, seed=8, coarse=True).double()
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m)) * 3
    xd = _quantized(x).double()
    expected, scale = xd @ coarse.T, xd.abs() @ coarse.abs().T
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    run = _bind(native_library._lib.signed_matmul, i32, p, i64, i64, i64, p, i64, p, i64, i32, i32)
    outputs = {}
    for isa in native_library.supported:
        y = torch.empty(m, 1000)
        assert run(x.data_ptr(), 640, m, 640, packed.pruning.coarse.data_ptr(), 1000, y.data_ptr(), 1000,
                   ISAS.index(isa), 2) == 0
        assert ((y.double() - expected).abs() <= 1e-5 * scale + 1e-30).all(), isa
        outputs[isa] = y
    assert all(torch.equal(y, outputs["portable"]) for y in outputs.values())


def test_rows_the_bounds_cannot_settle_run_the_exact_matmul(native_library):
    """Zero activations tie every column, more than a range's list holds; a NaN or an infinity
    bounds nothing. Those rows, and only those, run the exact matmul."""
    w = _head(70000, 64, seed=2)
    packed = native_library.pack(w)
    assert native_library.add_pruning(packed)
    x = _rows(w, 8, seed=3)
    x[2] = 0.0
    x[5, 7] = float("nan")
    x[6, 40] = float("inf")
    expected = _exact(packed, x)
    assert int(expected[2]) == 0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 8 ranges of 8750 columns: more than a list holds
        for isa in native_library.supported:
            tokens, exact_rows = native_library.pruned_argmax(x, packed, isa)
            assert torch.equal(tokens, expected), isa
            assert exact_rows == 3, isa
    finally:
        torch.set_num_threads(threads)


def test_a_weight_whose_rows_keep_running_exact_stops_pruning_for_a_while(native_library, head):
    w, packed = head
    unsettled = _rows(w, 8, seed=4)
    unsettled[:3, 0] = float("nan")  # 3 rows of 8 the bounds cannot settle
    assert torch.equal(packed.argmax(unsettled), _exact(packed, unsettled))
    assert packed.pruning.paused == PRUNING_PAUSE_CALLS
    calm = _rows(w, 8, seed=5)
    for left in range(PRUNING_PAUSE_CALLS - 1, -1, -1):
        assert torch.equal(packed.argmax(calm), _exact(packed, calm))
        assert packed.pruning.paused == left
    assert torch.equal(packed.argmax(calm), _exact(packed, calm))  # pruned again: every row settled
    assert packed.pruning.paused == 0
    unsettled[2, 0] = 1.0  # 2 of 8: a quarter, not more
    packed.argmax(unsettled)
    assert packed.pruning.paused == 0


def test_the_lm_head_gets_pruning_copies_where_they_pay(native_library, monkeypatch):
    w = _head(300, 64, seed=6)
    for isa in native_library.supported:
        monkeypatch.setenv("TOLLWAY_ISA", isa)
        library = Q8Library(native_library._lib)
        assert library.prunes_argmax == (isa == "avx2")  # only AVX2 runs coarse values faster
        head = LinearBuilder({"lm_head.weight": w}, {"q8"}, torch.device("cpu"), {}, q8=library).head("lm_head")
        assert (head.native.pruning is not None) == library.prunes_argmax


def test_scales_past_half_precision_once_coarse_get_no_pruning(native_library):
    w = _head(32, 64, seed=7)
    w[3, :32] *= 60000 / float(w[3, :32].abs().max() / 127)  # this block's scale becomes ~60000
    packed = native_library.pack(w)
    assert not native_library.add_pruning(packed) and packed.pruning is None
