"""Prefix cache LRU and KV helpers (CPU, no model)."""

import pytest
import torch

from rlpost.rollout.engines.prefix_cache import (
    PrefixCache,
    concat_batches,
    left_pad,
    pad_mask,
    repeat_rows,
    slice_columns,
)


def _kv(length: int, layers: int = 2, batch: int = 1):
    return [
        (torch.randn(batch, 2, length, 4), torch.randn(batch, 2, length, 4)) for _ in range(layers)
    ]


def test_exact_and_longest_prefix_hits():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3], _kv(3), torch.zeros(5), version=0)
    cache.insert([1, 2, 3, 4, 5], _kv(5), torch.ones(5), version=0)
    exact = cache.lookup([1, 2, 3, 4, 5], version=0)
    assert exact.tokens == (1, 2, 3, 4, 5) and torch.equal(exact.logits, torch.ones(5))
    longest = cache.lookup([1, 2, 3, 4, 9, 9], version=0)
    assert longest.tokens == (1, 2, 3)
    assert cache.lookup([2, 3], version=0) is None
    assert (cache.hits, cache.misses, cache.reused_tokens) == (2, 1, 8)


def test_stale_version_never_served():
    cache = PrefixCache()
    cache.insert([1, 2], _kv(2), torch.zeros(3), version=0)
    assert cache.lookup([1, 2], version=1) is None
    cache.clear()
    assert len(cache) == 0 and cache.total_tokens == 0


def test_lru_evicts_oldest_by_tokens_and_entries():
    cache = PrefixCache(max_tokens=10, max_entries=3)
    cache.insert([1, 2, 3, 4], _kv(4), torch.zeros(1), 0)
    cache.insert([5, 6, 7, 8], _kv(4), torch.zeros(1), 0)
    cache.lookup([1, 2, 3, 4], 0)  # touch: [5..8] is now least recently used
    cache.insert([9, 9, 9], _kv(3), torch.zeros(1), 0)  # 11 tokens > 10: evict one
    assert cache.lookup([5, 6, 7, 8], 0) is None
    assert cache.lookup([1, 2, 3, 4], 0) is not None
    assert cache.total_tokens == 7
    cache.insert([1], _kv(1), torch.zeros(1), 0)
    cache.insert([2], _kv(1), torch.zeros(1), 0)  # 4 entries > 3
    assert len(cache) == 3
    cache.insert(list(range(20)), _kv(20), torch.zeros(1), 0)  # larger than the cache: skipped
    assert cache.total_tokens <= 10


def test_disabled_cache_stores_nothing():
    cache = PrefixCache(max_tokens=0)
    cache.insert([1], _kv(1), torch.zeros(1), 0)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        PrefixCache(max_tokens=-1)


def test_left_pad_concat_slice_keep_values_in_place():
    a, b = _kv(3, batch=2), repeat_rows(_kv(5), 3)
    merged = concat_batches([left_pad(a, 5), b])
    keys = merged[0][0]
    assert keys.shape == (5, 2, 5, 4)
    assert torch.equal(keys[:2, :, :2], torch.zeros(2, 2, 2, 4))  # padding on the left
    assert torch.equal(keys[:2, :, 2:], a[0][0])
    assert torch.equal(keys[2:], b[0][0])
    assert torch.equal(slice_columns(merged, 2)[0][0][:2], a[0][0])
    mask = pad_mask(torch.ones(2, 3, dtype=torch.long), 5)
    assert mask.tolist() == [[0, 0, 1, 1, 1]] * 2
    with pytest.raises(ValueError, match="shorter width"):
        left_pad(a, 2)
