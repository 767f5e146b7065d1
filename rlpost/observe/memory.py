"""Process memory: glibc's mmap threshold, set in the running process, and the free heap
given back after each step (docs/performance.md, "Memory").

Above its mmap threshold glibc maps an allocation (returned on ``free``), below it uses
the heap. The threshold rises when a large mapped block is freed (up to 32 MiB), so from
the second step on activations come from the heap, which fragments and grows. A fixed
threshold ends that at a cost in step time (every large tensor a fresh mapping); glibc
reads ``MALLOC_MMAP_THRESHOLD_`` only at start, so ``mallopt`` through ctypes (no library
wraps it) sets it. Freed heap pages stay until ``malloc_trim`` returns them: at
SmolLM2-135M a step kept ~150 MiB more without it, ~90 with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def _libc():
    lib = ctypes.CDLL(name) if (name := ctypes.util.find_library("c")) else None
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "gnu_get_libc_version") else None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (0: keep the dynamic one).
    True when set; False without glibc's ``mallopt`` (musl, macOS), nothing changed."""
    if nbytes < 0 or nbytes > MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold {nbytes} is outside 0..{MAX_MMAP_THRESHOLD} bytes")
    lib = _libc() if nbytes else None
    return lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def release_free_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the heap's free pages back to the system. True when
    some were returned; False otherwise or without glibc."""
    lib = _libc()
    return lib is not None and bool(lib.malloc_trim(ctypes.c_size_t(0)))
