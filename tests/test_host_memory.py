"""Huge-page memory for what every step streams: weights and KV."""
from __future__ import annotations

import sys

import pytest
import torch

from tollway.model.host_memory import HUGE_PAGE, HugePageArena, huge_page_empty


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


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
