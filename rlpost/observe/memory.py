"""Process memory (docs/performance.md, "Memory"): glibc's mmap threshold set in the running
process (``mallopt`` through ctypes: glibc reads ``MALLOC_MMAP_THRESHOLD_`` only at start and
no library wraps it), the free heap given back after each step (``malloc_trim``), and the CPU
kernel caches bounded (an entry per input shape, so a run's memory grew with its lengths).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's
KERNEL_CACHE_ENTRIES = 32  # RSS flat at SmolLM2 where the default 1,024 grew 130 MiB a step


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap oneDNN's and ideep's kernel caches (read once, at the first kernel built) in this
    process and its children; a value the user set stands."""
    for name in KERNEL_CACHES:
        os.environ.setdefault(name, str(entries))


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
