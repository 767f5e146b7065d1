"""Prefix cache: a prompt's KV computed once, reused by its group and by repeats.

Lookup returns the longest cached prefix: an exact hit skips the prefill, a partial one
prefills the suffix. A weight update clears the cache. KV: ``(keys, values)`` ``[B, H, L, D]``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each ``[B, H, L, D]``."""


@dataclass
class PrefixEntry:
    """KV of ``tokens`` (``kv`` layers ``[1, H, len(tokens), D]``) and the logits after them (``[V]``)."""

    tokens: tuple[int, ...]
    kv: LayerKV
    logits: torch.Tensor
    version: int


class PrefixCache:
    """LRU map from token prefixes to their KV, bounded by ``max_tokens`` and ``max_entries``."""

    def __init__(self, max_tokens: int = 65536, max_entries: int = 1024) -> None:
        if max_tokens < 0 or max_entries < 0:
            raise ValueError("prefix cache max_tokens and max_entries must be >= 0")
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # cached prefix length -> how many entries have it
        self.total_tokens = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list[int], version: int) -> PrefixEntry | None:
        """The entry for the longest cached prefix of ``tokens`` computed at ``version``, or None."""
        for length in sorted(self._lengths, reverse=True):
            if length > len(tokens):
                continue
            key = tuple(tokens[:length])
            entry = self._entries.get(key)
            if entry is not None and entry.version == version:
                self._entries.move_to_end(key)
                self.hits += 1
                self.reused_tokens += length
                return entry
        self.misses += 1
        return None

    def insert(self, tokens: list[int], kv: LayerKV, logits: torch.Tensor, version: int) -> None:
        """Cache the KV (``[1, H, len(tokens), D]`` per layer) and next-token logits ``[V]``."""
        key = tuple(tokens)
        if not key or len(key) > self.max_tokens or self.max_entries == 0:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = PrefixEntry(key, kv, logits, version)
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.total_tokens += len(key)
        while self.total_tokens > self.max_tokens or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Forget every entry (new weights make all cached KV stale)."""
        self._entries.clear()
        self._lengths.clear()
        self.total_tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.total_tokens -= len(key)
        self._lengths[len(key)] -= 1
        if self._lengths[len(key)] == 0:
            del self._lengths[len(key)]

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "tokens": self.total_tokens,
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
        }


def cache_tensors(cache: DynamicCache) -> LayerKV:
    """The per-layer (keys, values) ``[B, H, L, D]`` held by ``cache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from(kv: LayerKV) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv``; the model appends to it without touching ``kv``."""
    return DynamicCache(ddp_cache_data=kv)


def left_pad(kv: LayerKV, width: int) -> LayerKV:
    """Zero-pad every layer on the left along the length axis to ``width`` (masked positions)."""
    length = kv[0][0].shape[-2]
    if length == width:
        return kv
    if length > width:
        raise ValueError(f"cannot left-pad KV of length {length} to a shorter width {width}")

    def pad(t: torch.Tensor) -> torch.Tensor:
        zeros = t.new_zeros(*t.shape[:-2], width - length, t.shape[-1])
        return torch.cat([zeros, t], dim=-2)

    return [(pad(k), pad(v)) for k, v in kv]


def concat_batches(parts: list[LayerKV]) -> LayerKV:
    """Stack batches of equal width along the batch axis."""
    return [
        (torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts]))
        for i in range(len(parts[0]))
    ]


def slice_columns(kv: LayerKV, start: int) -> LayerKV:
    """Drop the first ``start`` positions of every layer (columns that are padding in every row)."""
    return [(k[:, :, start:].contiguous(), v[:, :, start:].contiguous()) for k, v in kv]


def repeat_rows(kv: LayerKV, n: int) -> LayerKV:
    """Repeat a batch-of-one KV ``n`` times along the batch axis (a view until it is written)."""
    return [(k.expand(n, *k.shape[1:]), v.expand(n, *v.shape[1:])) for k, v in kv]


def pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a ``[B, L]`` attention mask with zeros to ``[B, width]``."""
    if mask.shape[1] == width:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)
