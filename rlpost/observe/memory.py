"""Process memory: glibc's mmap threshold, set in the running process, and the free heap
given back after each step.

glibc serves an allocation above its mmap threshold with its own ``mmap`` (returned
to the system on ``free``) and anything smaller from the heap. The threshold is
dynamic by default: freeing a large mmapped block raises it to that block's size
(up to 32 MiB), so from the second training step on, activations and gradients
come from the heap, which fragments and keeps growing (docs/performance.md,
"Memory"). A fixed threshold ends that at a cost in step time (every large tensor
is a fresh, zero-filled mapping). glibc reads ``MALLOC_MMAP_THRESHOLD_`` only at
process start, so a running process sets it with ``mallopt``; ctypes is the only
way to reach it from Python (no library wraps it).
Freed pages inside the heap stay in the process until ``malloc_trim`` returns them: at
SmolLM2-135M a step kept ~150 MiB more without it, ~90 with it (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "gnu_get_libc_version") else None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for the rest of this process (0: leave
    the dynamic default). True when it was set; False on a C library without ``mallopt``
    (musl, macOS), where nothing changes. ``nbytes`` above 32 MiB is refused by glibc."""
    if nbytes < 0 or nbytes > MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold {nbytes} is outside 0..{MAX_MMAP_THRESHOLD} bytes")
    if nbytes == 0:
        return False
    lib = _libc()
    if lib is None:
        return False
    return bool(lib.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def release_free_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the heap's free pages back to the system. True when
    some were returned; False otherwise or without glibc."""
    lib = _libc()
    return lib is not None and bool(lib.malloc_trim(ctypes.c_size_t(0)))
