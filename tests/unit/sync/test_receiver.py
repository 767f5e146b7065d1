"""The receiver commits whole versions only: dead senders, corrupt buckets, bad manifests (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.sync import DeltaRefused, Receiver, SyncError
from rlpost.sync.codecs import encode
from rlpost.sync.session import BucketPacker, SessionMeta, checksum
from tests.unit.sync.engines import DictEngine, toy_weights

SIZE = 4096


def _session(tensors, version=1, session="s1", size=SIZE):
    packer = BucketPacker(session, size)
    buckets = []
    for name, t in tensors.items():
        enc = encode(name, t, "bf16")
        buckets += packer.add(name, enc, checksum(enc.parts["data"]))
    buckets += packer.flush()
    return SessionMeta(session, version, "bf16", size), buckets, packer.manifest()


@pytest.fixture
def setup():
    old, new = toy_weights(0), toy_weights(1)
    engine = DictEngine(old)
    return engine, old, new


def _unchanged(engine, old):
    return engine.version == 0 and all(torch.equal(engine.weights[k], v) for k, v in old.items())


@pytest.mark.parametrize("spool", [False, True])
def test_a_sender_that_dies_mid_session_leaves_the_old_version(setup, tmp_path, spool):
    engine, old, new = setup
    receiver = Receiver(engine, spool_dir=tmp_path if spool else None)
    meta, buckets, manifest = _session(new)
    assert len(buckets) > 4
    receiver.start(meta)
    for b in buckets[: len(buckets) // 2]:
        receiver.update(b)
    assert _unchanged(engine, old) and engine.loads == 0
    # The sender restarts: its new session replaces the half-finished one, spool files go.
    meta2, buckets2, manifest2 = _session(new, version=2, session="s2")
    receiver.start(meta2)
    assert not list(tmp_path.iterdir())
    with pytest.raises(SyncError, match="no open session s1"):
        receiver.finish(manifest)
    assert _unchanged(engine, old)
    receiver.start(meta2)
    for b in buckets2:
        receiver.update(b)
    report = receiver.finish(manifest2)
    assert engine.version == report.version == 2 and engine.loads == 1
    for k, v in new.items():
        assert torch.equal(engine.weights[k], v.to(torch.bfloat16).float())


def test_corrupted_bucket_is_refused_and_the_engine_keeps_its_version(setup):
    engine, old, new = setup
    receiver = Receiver(engine, name="engine-7")
    meta, buckets, manifest = _session(new)
    receiver.start(meta)
    receiver.update(buckets[0])
    buckets[1].payload[10] ^= 0xFF  # a flipped byte in transit
    with pytest.raises(SyncError) as info:
        receiver.update(buckets[1])
    assert (
        str(info.value)
        == "weight sync update on engine-7: bucket 1 failed its CRC check (corrupted)"
    )
    with pytest.raises(SyncError, match="no open session"):
        receiver.finish(manifest)
    assert _unchanged(engine, old)


def test_missing_or_reordered_buckets_and_bad_checksums_are_refused(setup):
    engine, old, new = setup
    receiver = Receiver(engine)
    meta, buckets, manifest = _session(new)
    receiver.start(meta)
    with pytest.raises(SyncError, match="bucket 1 arrived, expected 0"):
        receiver.update(buckets[1])
    receiver.start(meta)
    for b in buckets[:-1]:
        receiver.update(b)
    with pytest.raises(SyncError, match=f"{len(buckets) - 1} of {len(buckets)} buckets arrived"):
        receiver.finish(manifest)
    manifest.tensors[2].checksum ^= 1  # the sender meant other values than the buckets hold
    receiver.start(meta)
    for b in buckets:
        receiver.update(b)
    name = manifest.tensors[2].name
    with pytest.raises(SyncError, match=f"tensor '{name}' does not match its checksum; refused"):
        receiver.finish(manifest)
    assert _unchanged(engine, old)


def test_a_bucket_whose_entries_overrun_its_payload_is_refused(setup):
    engine, old, new = setup
    receiver = Receiver(engine, name="e")
    meta, buckets, _ = _session(new)
    receiver.start(meta)
    buckets[0].entries[0][3] += 1  # one byte more than the payload holds
    with pytest.raises(SyncError, match="bucket 0 has entries outside its payload"):
        receiver.update(buckets[0])
    assert _unchanged(engine, old)


def test_delta_against_another_base_is_refused_at_start(setup):
    engine, _, _ = setup
    receiver = Receiver(engine, name="e")
    with pytest.raises(
        DeltaRefused, match="delta against version 4 refused: this engine holds no base"
    ):
        receiver.start(SessionMeta("s", 5, "bf16", SIZE, delta=True, base_version=4))
    assert not receiver.in_session


def test_an_idle_session_expires(setup):
    engine, old, new = setup
    receiver = Receiver(engine, timeout_s=0.0)  # any wait is too long
    meta, buckets, _ = _session(new)
    receiver.start(meta)
    with pytest.raises(SyncError, match="expired after 0 s idle"):
        receiver.update(buckets[0])
    assert _unchanged(engine, old)


def test_an_engine_that_refuses_the_weights_is_a_commit_error(setup):
    engine, _, new = setup
    receiver = Receiver(engine, name="e")
    meta, buckets, manifest = _session({**new, "not.a.weight": torch.ones(2)})
    receiver.start(meta)
    for b in buckets:
        receiver.update(b)
    with pytest.raises(SyncError, match="weight sync commit on e: KeyError"):
        receiver.finish(manifest)
    assert receiver.version == 0
