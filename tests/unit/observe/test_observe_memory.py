"""Process memory: glibc's mmap threshold and heap, the kernel caches (rlpost.observe.memory)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.observe.memory import KERNEL_CACHE_ENTRIES, KERNEL_CACHES, set_mmap_threshold

GLIBC = platform.libc_ver()[0] == "glibc"

# 200 blocks of 120 KiB sit under glibc's default threshold (128 KiB), so all come from the
# heap; with the threshold fixed at 64 KiB those that no free heap chunk holds (most: the
# heap has a few MiB free at start) get their own mappings. Each case runs in a fresh
# process: the threshold is process-wide and never unset.
PROBE = """
import ctypes, sys
from rlpost.observe.memory import KERNEL_CACHE_ENTRIES, KERNEL_CACHES, set_mmap_threshold
print(set_mmap_threshold(int(sys.argv[1])))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
addrs = [libc.malloc(120 * 1024) for _ in range(200)]
heap = [l for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split()[0].split("-"))
print(sum(not lo <= a < hi for a in addrs))
"""


def _mapped(threshold: int) -> tuple[bool, int]:
    """(whether the threshold was set, how many of the 200 blocks got their own mapping)"""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threshold)], capture_output=True, text=True, check=True
    )
    was_set, mapped = out.stdout.split()
    return was_set == "True", int(mapped)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_fixed_threshold_maps_a_block_the_default_puts_on_the_heap():
    assert _mapped(0) == (False, 0)
    was_set, mapped = _mapped(64 * 1024)
    assert was_set and mapped >= 150


def test_out_of_range_thresholds_are_refused():
    with pytest.raises(ValueError, match="outside"):
        set_mmap_threshold(-1)
    with pytest.raises(ValueError, match="outside"):
        set_mmap_threshold(64 * 1024 * 1024)
    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        load_config(None, ["run.malloc_mmap_threshold=-5"])
    assert (
        load_config(None, ["run.malloc_mmap_threshold=131072"]).run.malloc_mmap_threshold == 131072
    )


# 200 touched blocks of 120 KiB on the heap, all freed but the last: the free pages sit
# below a live block, so free() cannot shrink the heap; malloc_trim returns them.
TRIM = """
import ctypes
from rlpost.observe.memory import release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
addrs = [libc.malloc(120 * 1024) for _ in range(200)]
for a in addrs:
    ctypes.memset(a, 1, 120 * 1024)
for a in addrs[:-1]:
    libc.free(ctypes.c_void_p(a))
before = rss()
print(release_free_heap(), before - rss())
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_free_heap_returns_the_pages_a_free_left_on_the_heap():
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, check=True)
    released, mib = out.stdout.split()
    assert released == "True" and int(mib) >= 15


CACHES = """
import os, sys
from rlpost.cli import main
main(["config", "grpo_arith"])
print("CAPS", os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), os.environ["LRU_CACHE_CAPACITY"])
"""


@pytest.mark.parametrize("user", [None, "7"])
def test_every_command_caps_the_kernel_caches_unless_the_user_set_them(user):
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    if user:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = user
    out = subprocess.run(
        [sys.executable, "-c", CACHES], capture_output=True, text=True, check=True, env=env
    )
    caps = out.stdout.rsplit("CAPS", 1)[1].split()
    assert caps == [user or str(KERNEL_CACHE_ENTRIES), str(KERNEL_CACHE_ENTRIES)]
