"""Buckets: splitting into bucket_bytes, reassembly, the wire format (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.sync.codecs import encode
from rlpost.sync.receiver import Receiver
from rlpost.sync.session import Bucket, BucketPacker, SessionMeta, checksum
from tests.unit.sync.engines import DictEngine, toy_weights


def _pack(tensors: dict[str, torch.Tensor], size: int, codec: str = "none"):
    packer = BucketPacker("s1", size)
    buckets = []
    for name, t in tensors.items():
        enc = encode(name, t, codec)
        buckets += packer.add(name, enc, checksum(enc.parts["data"]))
    buckets += packer.flush()
    return packer, buckets


def test_tensors_larger_than_a_bucket_are_split_and_buckets_are_full():
    tensors = {"big": torch.arange(1000, dtype=torch.float32), "small": torch.ones(3)}
    packer, buckets = _pack(tensors, size=1024)
    total = 1000 * 4 + 3 * 4
    assert len(buckets) == math.ceil(total / 1024) == packer.manifest().buckets
    assert [b.payload.numel() for b in buckets] == [1024] * 3 + [total - 3 * 1024]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    first = buckets[0].entries[0]
    assert first == ["big::data", 4000, 0, 1024]  # key, part bytes, offset, length
    assert buckets[3].entries == [["big::data", 4000, 3072, 928], ["small::data", 12, 0, 12]]


@pytest.mark.parametrize("size", [1, 100, 4096, 1 << 30])
def test_reassembly_is_exact_for_any_bucket_size(size):
    tensors = toy_weights()
    if size == 1:  # a bucket per byte: keep it small
        tensors = {"a": torch.randn(3, 5), "b": torch.zeros(0), "c": torch.randn(7)}
    packer, buckets = _pack(tensors, size)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in tensors.items()})
    receiver = Receiver(engine)
    receiver.start(SessionMeta("s1", 3, "none", size))
    for b in buckets:
        receiver.update(b)
    receiver.finish(packer.manifest())
    assert engine.version == 3
    for name, t in tensors.items():
        assert torch.equal(engine.weights[name], t)


def test_bucket_bytes_round_trip_and_garbage_is_refused_in_one_line():
    _, buckets = _pack({"w": torch.randn(10, 10)}, 128)
    b = Bucket.from_bytes(buckets[1].to_bytes())
    assert b.header() == buckets[1].header() and torch.equal(b.payload, buckets[1].payload)
    with pytest.raises(ValueError, match="not a valid safetensors bucket") as info:
        Bucket.from_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{nonsense")
    assert "\n" not in str(info.value)
