"""Huge-page memory for what every step streams: weights and KV."""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from tollway.model.host_memory import HUGE_PAGE, HugePageArena, huge_page_empty, populate_in_background


def _smaps(address: int, field: str) -> list[str]:
    """The values of `field` (VmFlags, Rss...) for the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps(address, "VmFlags")


def _resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the pages under `t` (mincore), not of its whole mapping: the kernel merges
    neighbouring anonymous mappings with the same advice, so a fresh one can share a mapping with
    memory written long before."""
    start = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
    pages = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_a_huge_page_tensor_is_aligned_writable_and_advised():
    t = huge_page_empty(3 * HUGE_PAGE + 100)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 100
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(3)
    assert int(t[-1]) == 3
    if sys.platform == "linux":
        flags = _vm_flags(t.data_ptr())
        assert "hg" in flags  # MADV_HUGEPAGE
        assert "sh" not in flags  # private: THP leaves shared anonymous memory (shmem) alone


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps and madvise are Linux's")
def test_a_server_faults_its_kv_memory_in_on_a_thread_of_its_own():
    written = huge_page_empty(8 * HUGE_PAGE)
    written.fill_(1)  # a resident neighbour the kernel may merge the next mappings into
    k, v = huge_page_empty(6 * HUGE_PAGE), huge_page_empty(4 * HUGE_PAGE + 4096)
    assert _resident_bytes(written) == 8 * HUGE_PAGE
    assert _resident_bytes(k) + _resident_bytes(v) == 0  # nothing written yet
    thread = populate_in_background([k, v[4096:]])
    thread.join(timeout=60)
    assert not thread.is_alive()
    if _resident_bytes(k) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert _resident_bytes(k) == 6 * HUGE_PAGE
    assert _resident_bytes(v[4096:]) == 4 * HUGE_PAGE  # from the page holding the view's start
    assert int(k.max()) == 0 and int(v.max()) == 0  # a fresh page reads as zeros: nothing written


def test_the_arena_packs_small_tensors_together_and_big_ones_alone():
    arena = HugePageArena(chunk=HUGE_PAGE)
    a, b = arena.empty(1000), arena.empty(5000)
    assert (a.numel(), b.numel()) == (1000, 5000)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() == a.data_ptr() + 1024  # 64-byte aligned, in order
    big = arena.empty(3 * HUGE_PAGE)
    assert big.numel() == 3 * HUGE_PAGE and big.data_ptr() % HUGE_PAGE == 0
    c = arena.empty(HUGE_PAGE - 6000)  # past what the first chunk has left: a new chunk
    assert c.data_ptr() % HUGE_PAGE == 0 and c.data_ptr() != a.data_ptr()
    for t, v in ((a, 1), (b, 2), (big, 3), (c, 4)):
        t.fill_(v)
    assert [int(t.sum()) for t in (a, b, c)] == [1000, 10000, 4 * (HUGE_PAGE - 6000)]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_packed_weights_and_the_kv_cache_live_in_huge_page_memory(native_library):
    from tollway.model.layers import KVCache

    packed = native_library.pack(torch.randn(64, 64), HugePageArena())
    assert "hg" in _vm_flags(packed.data.data_ptr())
    cache = KVCache(1024, 1, 256, torch.float32, torch.device("cpu"))
    assert cache.k.shape == (1024, 1, 256) and "hg" in _vm_flags(cache.k.data_ptr())
    assert cache.v.data_ptr() != cache.k.data_ptr()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps and madvise are Linux's")
def test_an_engine_hands_back_the_thread_faulting_its_kv_pool_in(make_engine):
    """A benchmark waits on it, so that no measured step pays for the pages it first writes."""
    engine = make_engine(num_blocks=64)
    caches = [t for cache in engine.runner.caches for t in (cache.k, cache.v)]
    thread = engine.runner.fault_in_kv()
    thread.join(timeout=60)
    assert not thread.is_alive()
    if _resident_bytes(caches[0]) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert all(_resident_bytes(t) >= t.numel() * t.element_size() for t in caches)
