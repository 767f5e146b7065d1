"""Process memory: glibc's mmap threshold, set in the running process, and the free heap
given back after each step (docs/performance.md, "Memory").

Above its mmap threshold glibc maps an allocation (returned on ``free``), below it uses
the heap. The threshold rises when a large mapped block is freed (up to 32 MiB), so from
the second step on activations come from the heap, which fragments and grows. A fixed
threshold ends that at a cost in step time (every large tensor a fresh mapping); glibc
reads ``MALLOC_MMAP_THRESHOLD_`` only at start, so ``mallopt`` through ctypes (no library
wraps it) sets it. Freed heap pages stay until ``malloc_trim`` returns them: at
SmolLM2-135M a step kept ~150 MiB more without it, ~90 with it.

The rest of a step's growth was the CPU kernels' caches, one entry per input shape: oneDNN's
primitive cache and ideep's (torch's oneDNN wrapper), 1,024 entries each by default, and
every new response length adds entries. :func:`bound_kernel_caches` caps both through their
environment variables, read once at the first kernel built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's
KERNEL_CACHE_ENTRIES = 32
"""At SmolLM2-135M, 6 steps of 48-token GRPO: RSS flat instead of +130 MiB a step, the
step no slower (docs/performance.md, "Memory at SmolLM2-135M")."""


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap the CPU kernel caches at ``entries`` each in this process and its children; a
    value the user set stands. Takes effect where no oneDNN kernel was built yet."""
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
