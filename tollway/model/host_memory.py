"""Host memory for the CPU engine: freed heap kept in the process, and huge pages for what
every step streams through.

glibc serves large allocations with mmap and unmaps them on free, so every step's
fresh activations (a [64, 262144] logits tensor, gathered KV) would page-fault in again,
each page cleared by the kernel first.

A decode step reads every packed weight and its sequences' KV: in 4 KiB pages that is tens of
thousands of TLB misses a step. Linux backs memory advised with MADV_HUGEPAGE by 2 MiB pages
where it can (the default THP mode is "madvise"), which shortens the batch-1 matmuls markedly.

A server faults its KV pool in at start, on a thread of its own (populate_in_background): the
steps that first write a page otherwise wait for the kernel to find and clear it.
"""
from __future__ import annotations

import ctypes
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; Python's mmap module does not name it

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None where it
    does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def keep_freed_memory() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    try:  # by name: ctypes.util.find_library would spawn ldconfig, seconds at every start
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def return_freed_memory() -> None:
    """Gives the heap's free pages back to the system, once, after loading: building the tokenizer
    parses a JSON file of tens of MB into a tree twice the size of what it keeps, and
    keep_freed_memory would hold that peak for the process's life."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its own policy stands
        pass


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes` in a fresh anonymous mapping advised for huge
    pages, starting on a 2 MiB boundary. Its pages are faulted in at first touch; the tensor
    keeps the mapping alive."""
    # Private: a shared anonymous mapping is shmem, which THP leaves alone by default.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only; elsewhere plain pages
    if advice is not None:
        mapping.madvise(advice)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


class HugePageArena:
    """Packed weights carved one after another out of huge-page mappings of at least `chunk`
    bytes: a layer's weights are each a few MB, too small to fill huge pages of their own."""

    def __init__(self, chunk: int = 64 << 20):
        self.chunk = chunk
        self._free = torch.empty(0, dtype=torch.uint8)

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of `nbytes`, 64-byte aligned."""
        taken = -(-nbytes // 64) * 64
        if taken > self._free.numel():
            if taken >= self.chunk:
                return huge_page_empty(nbytes)
            self._free = huge_page_empty(self.chunk)
        out, self._free = self._free[:nbytes], self._free[taken:]
        return out


def populate(tensors: list[torch.Tensor]) -> bool:
    """Faults in the pages behind `tensors` now, as a first write would; False where the kernel
    cannot (before Linux 5.14, or not Linux), which leaves them to fault in when written."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    for t in tensors:
        start = t.data_ptr() - t.data_ptr() % _PAGE
        length = t.data_ptr() + t.numel() * t.element_size() - start
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
            return False
    return True


def populate_in_background(tensors: list[torch.Tensor]) -> threading.Thread:
    """populate(tensors) on a daemon thread (ctypes lets go of the GIL meanwhile). A VM that backs
    a guest page at its first touch makes each fresh huge page slow to fault in: a fresh server
    would otherwise pay for its KV pool within its first steps, as streams fill it."""
    thread = threading.Thread(target=populate, args=(tensors,), name="tollway-populate", daemon=True)
    thread.start()
    return thread
