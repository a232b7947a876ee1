"""The compiled row-wise ops agree with the torch reference, and a row's bits never depend
on the rows around it."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from tollway.model.attention_metadata import step_metadata
from tollway.model.layers import KVCache, Rotary
from tollway.model.native.qmatmul import q8_library
from tollway.model.row_ops import NativeRowOps, TorchRowOps, row_ops_for, row_ops_library
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

CLOSE = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def native(native_cache):
    ops = row_ops_for(torch.device("cpu"), 256, native_cache)
    assert isinstance(ops, NativeRowOps)
    return ops


def _pairs(native, make):
    """(native result, torch result) of one op on the same fresh inputs."""
    return make(native), make(TorchRowOps())


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_norms_match_torch(native, rows):
    g = torch.Generator().manual_seed(rows)
    x, h = torch.randn(rows, 640, generator=g) * 3, torch.randn(rows, 640, generator=g)
    w1, w2 = torch.rand(640, generator=g) + 0.5, torch.rand(640, generator=g) + 0.5
    for weight in (w1, None):
        torch.testing.assert_close(native.rms_norm(x, weight, 1e-6), TorchRowOps().rms_norm(x, weight, 1e-6), **CLOSE)
    for h_weight, weight in ((w1, w2), (None, w2), (w1, None), (None, None)):
        xa, xb = x.clone(), x.clone()
        na = native.add_rms_norm(xa, h, h_weight, weight, 1e-6)
        nb = TorchRowOps().add_rms_norm(xb, h, h_weight, weight, 1e-6)
        torch.testing.assert_close(xa, xb, **CLOSE)  # the residual is updated in place by both
        assert (na is None) == (nb is None) == (weight is None)
        if na is not None:
            torch.testing.assert_close(na, nb, **CLOSE)


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_torch(native, with_norm):
    heads, kv_heads, d = 4, 1, 256
    rotary = Rotary(d, 10_000.0, 64, None, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g)  # q, k, then v: the kernel reads a strided prefix
    weight = torch.rand(heads + kv_heads, d, generator=g) + 0.5 if with_norm else None
    positions = torch.tensor([0, 7, 8, 40, 63])
    got, want = _pairs(native, lambda ops: ops.qk_norm_rope(qkv, heads + kv_heads, d, weight, 1e-6, rotary, positions))
    assert got.shape == want.shape == (5, heads + kv_heads, d)
    torch.testing.assert_close(got, want, **CLOSE)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gated_activation_matches_torch(native, activation):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(6, 2 * 300, generator=g) * 4
    gate_up[0, :4] = torch.tensor([0.0, 50.0, -50.0, 1e-30])  # saturated and tiny inputs
    got, want = _pairs(native, lambda ops: ops.gated(gate_up, 300, activation))
    torch.testing.assert_close(got, want, **CLOSE)


def test_a_row_alone_equals_the_same_row_in_a_batch(native):
    g = torch.Generator().manual_seed(3)
    x, h, w = torch.randn(9, 640, generator=g), torch.randn(9, 640, generator=g), torch.rand(640, generator=g)
    batch_x, alone_x = x.clone(), x[4:5].clone()
    batch = native.add_rms_norm(batch_x, h, w, w, 1e-6)
    alone = native.add_rms_norm(alone_x, h[4:5], w, w, 1e-6)
    assert torch.equal(batch[4:5], alone) and torch.equal(batch_x[4:5], alone_x)
    gate_up = torch.randn(9, 64, generator=g)
    assert torch.equal(native.gated(gate_up, 32, "gelu_tanh")[4:5], native.gated(gate_up[4:5], 32, "gelu_tanh"))


@pytest.mark.slow  # a process of its own
def test_the_build_is_reused_and_a_broken_compiler_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    first = row_ops_library(tmp_path)
    assert first is not None and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert row_ops_library(tmp_path) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails: a different key, so a fresh build
    assert row_ops_library(tmp_path / "other") is None
    assert "row_ops.c" in caplog.text
    assert type(row_ops_for(torch.device("cpu"), 256, tmp_path / "other")) is TorchRowOps
    assert not list((tmp_path / "other").rglob("*.so")) and not list((tmp_path / "other").rglob(".row_ops-*"))


def _attention_step(window, dtype=torch.float32, d=32):
    """A step mixing two decodes (first, as the runner orders them) with two prefill chunks, one
    long enough to be split over two threads, over a cache whose earlier positions are filled."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, bs = 4, 2, 4
    blocks = torch.randperm(96, generator=g).tolist()
    specs = [("a", 40, 1), ("b", 5, 1), ("c", 10, 20), ("d", 0, 200)]  # (id, start, new tokens)
    seqs, positions, slots = [], [], []
    for rid, start, n in specs:
        table = tuple(blocks[:-(-(start + n) // bs)])
        blocks = blocks[len(table):]
        seqs.append(ScheduledSeq(rid, "standard", (1,) * n, start, table, True, SamplingParams(temperature=0)))
        positions += range(start, start + n)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
    cache = KVCache(96 * bs, kv_heads, d, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    qk = torch.randn(len(positions), heads + kv_heads, d, generator=g)
    v = torch.randn(len(positions), kv_heads, d, generator=g)
    return seqs, positions, slots, cache, qk, v, heads, bs


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_matches_torch(native, window, softcap, dtype):
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(window, dtype)
    kind = "sliding" if window else "full"
    results = []
    for ops in (native, TorchRowOps()):
        meta = step_metadata(seqs, positions, slots, bs, window or None, torch.device("cpu"), ops.needs_views)
        own = KVCache(cache.k.shape[0], cache.k.shape[1], cache.k.shape[2], dtype, torch.device("cpu"))
        own.k.copy_(cache.k), own.v.copy_(cache.v)
        results.append((ops.attention(qk, v, heads, own, meta, kind, window, 0.25, softcap), own))
    (got, got_cache), (want, want_cache) = results
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    torch.testing.assert_close(got, want, **CLOSE)


@pytest.fixture(scope="module")
def avx2_build(native_library, tmp_path_factory):
    """row_ops.c built as for a run forced to AVX2 (x86-64-v3: AVX2, FMA, F16C; no AVX-512), whatever this machine has."""
    if "avx2" not in native_library.supported:
        pytest.skip("needs a CPU that runs an AVX2 build")
    lib = row_ops_library(tmp_path_factory.mktemp("avx2"), "avx2")
    return NativeRowOps(ctypes.CDLL(str(lib)), native_library)


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.float16, 32), (torch.float16, 48)])
def test_attention_is_the_same_to_the_bit_from_an_avx2_build(native, avx2_build, window, softcap, dtype, d):
    """An AVX-512 build scores 4 keys per query load and sums 32 value columns per pass, an AVX2
    build 2 and 16 (d = 48 adds a 16-column pass to the 32s): each score and sum is the same
    float, so a machine's build never changes a token."""
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(window, dtype, d)
    kind = "sliding" if window else "full"
    meta = step_metadata(seqs, positions, slots, bs, window or None, torch.device("cpu"), False)
    got, want = (ops.attention(qk, v, heads, cache, meta, kind, window, 0.25, softcap) for ops in (native, avx2_build))
    assert torch.equal(got, want)


def test_an_sse2_build_for_the_portable_path_runs_the_same_attention_within_rounding(native, tmp_path):
    """x86-64 without AVX (a forced portable run, or such a CPU) builds row_ops.c too. Its sums
    round twice where the others fuse the multiply-add, so they agree within float rounding, not
    to the bit; the matmuls' paths still agree to the bit."""
    q8 = q8_library()
    if q8.below_best("portable") is None:
        pytest.skip("needs a CPU above the portable path")
    lib = row_ops_library(tmp_path, "portable")
    assert lib is not None  # the SIMD hints that need AVX registers stay out of it
    sse2 = NativeRowOps(ctypes.CDLL(str(lib)), q8)
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(24, torch.float16, 48)
    meta = step_metadata(seqs, positions, slots, bs, 24, torch.device("cpu"), False)
    got, want = (ops.attention(qk, v, heads, cache, meta, "sliding", 24, 0.25, 5.0) for ops in (native, sse2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_attention_of_a_token_does_not_depend_on_its_batch(native):
    """Bit for bit: a decode alone, and the last token of a chunk alone, equal themselves in the mixed step."""
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(24)
    device = torch.device("cpu")
    full = native.attention(qk, v, heads, cache, step_metadata(seqs, positions, slots, bs, 24, device, False),
                            "sliding", 24, 0.25, None)
    alone = native.attention(qk[:1], v[:1], heads, cache, step_metadata(seqs[:1], positions[:1], slots[:1], bs, 24,
                                                                          device, False), "sliding", 24, 0.25, None)
    assert torch.equal(full[:1], alone)
    last = len(positions) - 1
    tail_seq = ScheduledSeq("d", "standard", (1,), positions[last], seqs[3].block_table, True, seqs[3].params)
    tail = native.attention(qk[last:], v[last:], heads, cache, step_metadata([tail_seq], positions[last:], slots[last:],
                                                                           bs, 24, device, False), "sliding", 24, 0.25, None)
    assert torch.equal(full[last:], tail)


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_split_over_threads_equals_one_thread(native, window, dtype):
    """The step has 5,000-odd (token, key) pairs: past the split threshold, so two threads share it."""
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(window, dtype)
    kind = "sliding" if window else "full"
    meta = step_metadata(seqs, positions, slots, bs, window or None, torch.device("cpu"), False)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(native.attention(qk, v, heads, cache, meta, kind, window, 0.25, None))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("heads,kv_heads,window,softcap,dtype,d", [
    (4, 1, 0, None, torch.float16, 32), (4, 2, 0, None, torch.float16, 32), (8, 1, 0, None, torch.float16, 32),
    (6, 1, 700, 5.0, torch.float32, 48), (4, 1, 700, None, torch.float16, 256)])
def test_a_lone_decode_shared_by_threads_equals_one_thread(native, heads, kv_heads, window, softcap, dtype, d):
    """One token, fewer than the threads: they score slices of its keys, then sum slices of the value
    columns (48 columns: three 16-column slices over 2 threads, none for a fourth; 6 heads: a padded tile)."""
    g = torch.Generator().manual_seed(5)
    bs, context = 4, 2000
    table = tuple(torch.randperm(600, generator=g)[:context // bs + 1].tolist())
    seq = ScheduledSeq("a", "standard", (1,), context, table, True, SamplingParams(temperature=0))
    cache = KVCache(600 * bs, kv_heads, d, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    qk, v = torch.randn(1, heads + kv_heads, d, generator=g), torch.randn(1, kv_heads, d, generator=g)
    kind = "sliding" if window else "full"
    meta = step_metadata([seq], [context], [table[context // bs] * bs + context % bs], bs, window or None,
                         torch.device("cpu"), False)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            results.append(native.attention(qk, v, heads, cache, meta, kind, window, 0.25, softcap))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])
    want = TorchRowOps().attention(qk, v, heads, cache, step_metadata([seq], [context], meta.slot_mapping.tolist(), bs,
                                                                         window or None, torch.device("cpu"), True),
                                   kind, window, 0.25, softcap)
    torch.testing.assert_close(results[0], want, **CLOSE)


def test_attention_past_the_kept_scratch_equals_torch(native):
    """A decode over 40000 keys: its score buffers pass the 1 MB each thread keeps between calls
    (row_ops.c's take_scratch), on one thread (attend) and shared by two, so they come from malloc
    and are freed; a short decode after them runs on the kept buffers again."""
    g = torch.Generator().manual_seed(6)
    bs, heads, d = 16, 4, 16
    cache = KVCache(2600 * bs, 1, d, torch.float16, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    table = tuple(torch.randperm(2600, generator=g).tolist())
    before = torch.get_num_threads()
    try:
        for context in (40000, 40, 40000):
            seq = ScheduledSeq("a", "standard", (1,), context, table[:context // bs + 1], True,
                               SamplingParams(temperature=0))
            qk, v = torch.randn(1, heads + 1, d, generator=g), torch.randn(1, 1, d, generator=g)
            slots = [table[context // bs] * bs + context % bs]
            want = TorchRowOps().attention(qk, v, heads, cache, step_metadata(
                [seq], [context], slots, bs, None, torch.device("cpu"), True), "full", 0, 0.25, None)
            meta = step_metadata([seq], [context], slots, bs, None, torch.device("cpu"), False)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                torch.testing.assert_close(native.attention(qk, v, heads, cache, meta, "full", 0, 0.25, None), want,
                                           **CLOSE)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_a_thread_s_kept_attention_buffers_are_freed_when_it_exits(native):
    """Each thread keeps its attention buffers between calls; 300 short-lived threads, each running
    one decode over 3000 keys, must not leave them behind (they left ~21 MiB before)."""
    bs, heads, d, context = 16, 4, 256, 3000
    cache = KVCache(200 * bs, 1, d, torch.float16, torch.device("cpu"))
    table = tuple(range(200))
    seq = ScheduledSeq("a", "standard", (1,), context, table, True, SamplingParams(temperature=0))
    meta = step_metadata([seq], [context], [table[context // bs] * bs + context % bs], bs, None,
                         torch.device("cpu"), False)
    qk, v = torch.randn(1, heads + 1, d), torch.randn(1, 1, d)
    args = (qk, v, heads, cache, meta, "full", 0, 0.25, None)

    def resident_mib():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # attention on the calling thread, into its own kept buffers
    try:
        native.attention(*args)
        start = resident_mib()
        for _ in range(300):
            thread = threading.Thread(target=native.attention, args=args)
            thread.start()
            thread.join()
        assert resident_mib() - start < 5
    finally:
        torch.set_num_threads(before)


def test_decodes_fewer_than_the_threads_share_them_and_equal_one_thread(native):
    """Three decodes of different lengths on four threads (118 keys in all: past the sharing threshold)."""
    seqs, positions, slots, cache, qk, v, heads, bs = _attention_step(0)
    decodes = seqs[:2] + [ScheduledSeq("e", "standard", (1,), 70, seqs[3].block_table, True, seqs[3].params)]
    positions, slots = positions[:2] + [70], slots[:2] + [seqs[3].block_table[70 // bs] * bs + 70 % bs]
    rows = [0, 1, len(qk) - 1]
    meta = step_metadata(decodes, positions, slots, bs, None, torch.device("cpu"), False)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            results.append(native.attention(qk[rows], v[rows], heads, cache, meta, "full", 0, 0.25, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


def test_a_half_cache_rounds_as_torch_does_at_the_edges(native):
    """Keys and values written to a float16 cache round to nearest even as torch's .half():
    past 65504 to inf, tiny values to subnormals or zero, NaN stays NaN."""
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 2.9e-8, 3e-8, 1e-9, -0.0, 1.0 + 2**-11,
                          1.0 + 3 * 2**-11, float("inf"), float("nan"), 0.1, -3.14159])
    k = torch.randn(3, 1, 32)
    k.view(-1)[: len(edges)] = edges
    v = -k
    seqs, positions, slots = [], [0, 1, 2], [5, 2, 9]
    seqs.append(ScheduledSeq("a", "standard", (1, 2, 3), 0, (0, 1, 2), True, SamplingParams(temperature=0)))
    meta = step_metadata(seqs, positions, slots, 4, None, torch.device("cpu"), False)
    cache = KVCache(12, 1, 32, torch.float16, torch.device("cpu"))
    qk = torch.cat([torch.randn(3, 1, 32), k], dim=1)
    native.attention(qk, v, 1, cache, meta, "full", 0, 0.25, None)
    for got, want in ((cache.k[slots], k.half()), (cache.v[slots], v.half())):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit, NaN included


@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump")
def test_a_run_forced_to_avx2_builds_the_row_ops_for_an_avx2_cpu(native_cache, tmp_path, monkeypatch):
    """On an AVX-512 CPU, TOLLWAY_ISA=avx2 measures the AVX2 kernels; the attention and norms
    around them must then run as an AVX2-only CPU runs them too, not on AVX-512."""
    if "avx512vnni" not in q8_library().supported:
        pytest.skip("needs a CPU above AVX2")
    monkeypatch.setenv("TOLLWAY_ISA", "avx2")
    forced = row_ops_for(torch.device("cpu"), 256, tmp_path)  # its own libraries, built as a forced run does
    assert forced.build.endswith("-avx2")
    builds = {"own": row_ops_library(native_cache / "native"), "forced": tmp_path / "native" / f"{forced.build.split('+')[0]}.so"}
    code = {name: subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
            for name, lib in builds.items()}
    assert "%zmm" in code["own"]  # this CPU's own build uses AVX-512 ...
    assert "%ymm" in code["forced"] and "%zmm" not in code["forced"]  # ... the forced one never
