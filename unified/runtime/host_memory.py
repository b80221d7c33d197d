"""Keeping freed host memory in the process, so CPU engine steps do not page-fault on every allocation.

glibc hands freed memory back to the kernel eagerly: blocks above a threshold (128 KiB, adapting up to
32 MiB) are separate mappings, unmapped when freed, and the heap's free top is trimmed beyond twice that
threshold. An engine step on CPU allocates and frees the same activation buffers every step, so each
step faulted them in afresh: a 2048-token prefill chunk of SmolLM2 took ~260,000 minor faults and 1 s of
kernel time, a fifth of its CPU time, on our 2-core host. With buffers up to 32 MiB served from a heap
that is never trimmed, those faults happen once. The process's resident memory then stays at its peak,
as under a device's caching allocator. Larger blocks (KV caches, weights) are still mappings of their
own: a calloc'ed KV cache commits its pages as they are first written, unless prefault_in_background
commits them ahead.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit hosts


def retain_freed_host_memory() -> bool:
    """Tunes glibc's malloc as above; False where the C library is not glibc (nothing changes then)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, -1))


def release_freed_host_memory() -> bool:
    """Hands the heap's free pages back to the kernel now (glibc's malloc_trim), for a caller that just freed
    a lot and wants the resident memory to drop (a server going to sleep); False where not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


_MADV_HUGEPAGE, _MADV_POPULATE_WRITE, _MADV_COLLAPSE = 14, 23, 25  # Linux 2.6.38+, 5.14+, 6.1+
_PREFAULT_CHUNK = 64 << 20
_HUGE_PAGE = 2 << 20


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _huge_page_span(start: int, end: int) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside [start, end), which alone can be huge pages; None if there are none."""
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    return (first, last) if last > first else None


def back_with_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Moves the host tensors' memory, already written (weights), onto transparent huge pages (2 MiB) where the
    kernel can, and asks for them on the pages still to come. A decode step streams every weight once: on 4 KiB
    pages each page costs a TLB miss, dearer on a virtual machine (two levels of page tables to walk), so a stream
    over huge pages reads faster (bench/RESULTS.md). Moving costs a copy (about a second
    per GiB here); memory already on huge pages returns at once. Returns the bytes on huge pages; 0 where the
    kernel cannot (MADV_COLLAPSE is Linux 6.1+; transparent huge pages off; no free huge pages), which changes
    nothing else."""
    if not sys.platform.startswith("linux"):
        return 0
    madvise, done, moved = _madvise(), set(), 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue  # oneDNN's packed copies are opaque: no storage to reach
        storage = tensor.untyped_storage()
        if storage.data_ptr() in done:
            continue
        done.add(storage.data_ptr())
        span = _huge_page_span(storage.data_ptr(), storage.data_ptr() + storage.nbytes())
        if span is None:
            continue
        first, last = span
        madvise(first, last - first, _MADV_HUGEPAGE)
        if madvise(first, last - first, _MADV_COLLAPSE) == 0:
            moved += last - first
    return moved


def prefault_in_background(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Commits the pages of freshly calloc'ed host tensors (a KV cache) from a background thread, so that
    the engine's first steps do not fault them in one by one as they write: a fault costs microseconds on a
    virtual machine, and a 2 GiB cache written for the first time took ~70 us more per K/V write of a decode
    step. The pages are asked for as huge pages where the kernel has them (see back_with_huge_pages: attention
    streams the cache as decode steps stream the weights). MADV_POPULATE_WRITE never changes what the pages hold, so steps may write meanwhile. The thread
    keeps the tensors alive until it is done. It runs at the lowest priority (nice 19): at a few hundred MB/s
    on a virtual machine, a GiB takes seconds, and at normal priority it took a core from the steps' parallel
    kernels meanwhile (a decode matmul 20-40x slower while it ran on two cores). None where the kernel cannot
    (before Linux 5.14, not Linux)."""
    if not sys.platform.startswith("linux") or not tensors:
        return None
    madvise, page = _madvise(), os.sysconf("SC_PAGE_SIZE")

    def populate() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
        except OSError:
            pass
        for tensor in tensors:
            start = tensor.data_ptr() // page * page
            end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
            span = _huge_page_span(start, end)
            if span is not None:
                madvise(span[0], span[1] - span[0], _MADV_HUGEPAGE)  # before the pages exist
            for offset in range(start, end, _PREFAULT_CHUNK):
                if madvise(offset, min(_PREFAULT_CHUNK, end - offset), _MADV_POPULATE_WRITE) != 0:
                    return  # EINVAL: a kernel without it; the pages fault in as written

    thread = threading.Thread(target=populate, name="kv-cache-prefault", daemon=True)
    thread.start()
    return thread
