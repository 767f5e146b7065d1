"""The sender over in-process and disk targets: codecs, delta with fallback, verification (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from rlpost.config import SyncConfig
from rlpost.sync import Receiver, SyncError, build_weight_sync
from rlpost.sync.disk import latest_version, load_latest
from rlpost.sync.transports import InProcessTransport, TransportOptions
from rlpost.sync.weight_sync import WeightSync
from tests.unit.sync.engines import DictEngine, toy_weights


def _zeros(tensors):
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def _cfg(**kw) -> SyncConfig:
    return SyncConfig(bucket_mb=0.01, **kw)


@pytest.mark.parametrize("codec", ["none", "bf16", "fp8", "mxfp4"])
def test_push_reaches_every_engine_with_the_codecs_values(codec):
    w = toy_weights()
    engines = [DictEngine(_zeros(w)), DictEngine(_zeros(w))]
    sync = build_weight_sync(_cfg(codec=codec), engines)
    stats = sync.push(w.items(), version=3)
    assert stats.version == 3 and not stats.failed and len(stats.committed) == 2
    assert stats.buckets > 1 and stats.bytes == 2 * sum(_wire_bytes(w, codec).values())
    for e in engines:
        assert e.version == 3
        for name, t in w.items():
            err = (e.weights[name] - t).abs().max().item()
            lossy = codec in ("fp8", "mxfp4") and "up_proj" in name
            assert (
                err == 0 if codec == "none" else (0 < err if lossy else err <= t.abs().max() / 128)
            )


def _wire_bytes(w, codec):
    """Bytes each tensor costs, by hand: up_proj is [130, 260], the rest are kept in bf16."""
    sizes = {}
    for name, t in w.items():
        if codec == "none":
            sizes[name] = 4 * t.numel()
        elif codec == "bf16" or "up_proj" not in name:
            sizes[name] = 2 * t.numel()
        elif codec == "fp8":  # 1 byte each + a float32 scale for each of 2 x 3 blocks
            sizes[name] = 130 * 260 + 4 * 2 * 3
        else:  # mxfp4: rows padded to 9 blocks of 32 nibbles (16 bytes) + one scale byte each
            sizes[name] = 130 * 9 * 16 + 130 * 9
    return sizes


def test_delta_is_exact_and_a_restarted_engine_gets_a_full_sync():
    w = toy_weights()
    a, b = DictEngine(_zeros(w)), DictEngine(_zeros(w))
    sync = build_weight_sync(_cfg(codec={"name": "bf16", "delta": True}), [a, b])
    full = sync.push(w.items(), 1)
    stepped = {k: v - 1e-6 * torch.sign(torch.randn_like(v)) for k, v in w.items()}
    sync.transports[1].receiver = Receiver(b, name="b")  # b restarted: it lost its base
    stats = sync.push(stepped.items(), 2)
    assert not stats.failed and stats.delta_tensors == len(w)
    assert stats.metrics() == {
        "sync_seconds": stats.seconds,
        "sync_bytes": stats.bytes,
        "sync_pause_seconds": stats.pause_seconds,
        "sync_version": 2,
    }
    # a got the delta (small), b refused it and got the full bf16 encoding of the same pass
    assert full.bytes / 2 < stats.bytes < full.bytes / 2 * 1.1
    for e in (a, b):
        assert e.version == 2
        for k, v in stepped.items():
            assert torch.equal(e.weights[k], v.to(torch.bfloat16).float())


def test_verification_names_the_tensor_when_an_engine_does_not_report_it():
    w = toy_weights()
    engine = DictEngine(_zeros(w))
    silent = InProcessTransport(engine, TransportOptions(verify=False), name="silent")
    sync = WeightSync([silent], codec="bf16", bucket_bytes=4096, verify=True)
    with pytest.raises(SyncError) as info:
        sync.push(w.items(), 1)
    msg = str(info.value)
    assert "\n" not in msg and "verify on silent: tensor 'model.embed_tokens.weight'" in msg


def test_a_failing_engine_is_dropped_and_the_others_commit():
    w = toy_weights()
    good = DictEngine(_zeros(w))
    bad = DictEngine({k: v for k, v in _zeros(w).items() if "lm_head" not in k})
    sync = build_weight_sync(_cfg(codec="bf16"), [good, bad])
    stats = sync.push(w.items(), 1)
    assert stats.committed == ["DictEngine#0"] and good.version == 1
    assert stats.failed["DictEngine#1"].startswith("weight sync commit on DictEngine#1: KeyError")
    with pytest.raises(SyncError, match="weight sync push on every target"):
        build_weight_sync(_cfg(), [bad]).push(w.items(), 2)


def test_disk_publishes_whole_versions_and_readers_load_the_latest(tmp_path):
    w, w2 = toy_weights(0), toy_weights(1)
    sync = build_weight_sync(_cfg(channel="disk", codec="fp8"), [tmp_path / "weights"])
    root = tmp_path / "weights"
    reader = Receiver(DictEngine(_zeros(w)), name="reader")
    assert latest_version(root) is None and load_latest(root, reader) is None
    sync.push(w.items(), 1)
    assert (root / "LATEST").read_text() == "1"
    body = json.loads((root / "v0000000001" / "session.json").read_text())
    assert body["meta"]["codec"] == "fp8" and body["manifest"]["buckets"] > 1
    assert load_latest(root, reader).version == 1 and reader.engine.version == 1
    # A sender that dies after some buckets leaves only a temporary directory behind.
    t = sync.transports[0]
    sync.transports[0].start(_meta(2))
    assert latest_version(root) == 1 and load_latest(root, reader) is None
    sync.push(w2.items(), 3)
    assert not list(root.glob(".tmp-*")) and latest_version(root) == 3
    second = Receiver(DictEngine(_zeros(w)), name="second")
    for r in (reader, second):
        assert load_latest(root, r).version == 3
        assert torch.equal(
            r.engine.weights["lm_head.weight"], w2["lm_head.weight"].bfloat16().float()
        )
    assert t.target == str(root)


def _meta(version):
    from rlpost.sync.session import SessionMeta

    return SessionMeta.new(version, "fp8", 10240, False, None)


def test_delta_from_a_bf16_model_keeps_its_own_base():
    """bf16 weights encode to themselves; the sender's base is a copy, so stepping the live
    tensors in place does not move the base, and the next delta carries the step."""
    live = {k: v.to(torch.bfloat16) for k, v in toy_weights().items()}
    engine = DictEngine(_zeros(live))
    sync = build_weight_sync(_cfg(codec={"name": "bf16", "delta": True}), [engine])
    sync.push(live.items(), 1)
    with torch.no_grad():
        for v in live.values():
            v.add_(0.5)  # an optimizer step, in place
    stats = sync.push(live.items(), 2)
    assert not stats.failed and engine.version == 2
    for k, v in live.items():
        assert torch.equal(engine.weights[k].to(torch.bfloat16), v)


def test_a_transport_error_that_is_not_a_sync_error_drops_only_its_target():
    """A malformed reply (here a KeyError from a finish) fails that target in one line; the
    others commit and the push returns."""
    w = toy_weights()
    good_engine, odd_engine = DictEngine(_zeros(w)), DictEngine(_zeros(w))

    class Odd(InProcessTransport):
        def finish(self, manifest):
            raise KeyError("checksums")

    good = InProcessTransport(good_engine, TransportOptions(), name="good")
    odd = Odd(odd_engine, TransportOptions(), name="odd")
    stats = WeightSync([good, odd], codec="bf16", bucket_bytes=4096).push(w.items(), 1)
    assert stats.committed == ["good"] and good_engine.version == 1
    assert stats.failed["odd"] == "weight sync transport on odd: KeyError: 'checksums'"


@pytest.mark.parametrize("codec", ["fp8", "mxfp4"])
def test_lossy_codecs_send_empty_and_non_finite_tensors_as_bf16(codec):
    from rlpost.sync.codecs import decode, encode

    empty = encode("w", torch.zeros(0, 64), codec)
    assert empty.codec == "bf16" and decode(empty).shape == (0, 64)
    bad = torch.ones(4, 64)
    bad[1, 3] = float("nan")
    enc = encode("w", bad, codec)
    assert enc.codec == "bf16" and torch.isnan(decode(enc)[1, 3])
    assert encode("w", torch.ones(4, 64), codec).codec == codec


def test_a_restore_publishes_versions_readers_follow(tmp_path):
    """A resume or rollback reuses version numbers: under a new run id a disk reader loads
    the lower version instead of ignoring it as older; the same run id's older one it skips."""
    w, w2 = toy_weights(0), toy_weights(1)
    root = tmp_path / "weights"
    sync = build_weight_sync(_cfg(channel="disk", codec="bf16"), [root])
    reader = Receiver(DictEngine(_zeros(w)), name="reader")
    sync.push(w.items(), 5)
    assert load_latest(root, reader).version == 5 and reader.run_id == sync.run_id
    first = sync.run_id
    sync.restart_versions()  # the trainer went back to step 3
    assert sync.run_id != first
    sync.push(w2.items(), 3)
    report = load_latest(root, reader)
    assert report is not None and report.version == 3 and reader.run_id == sync.run_id
    assert torch.equal(
        reader.engine.weights["lm_head.weight"], w2["lm_head.weight"].bfloat16().float()
    )
    assert load_latest(root, reader) is None  # served already


def test_every_session_names_its_run_id():
    w = toy_weights()
    transport = InProcessTransport(DictEngine(_zeros(w)), TransportOptions())
    sync = WeightSync([transport], codec="bf16", bucket_bytes=4096)
    sync.push(w.items(), 1)
    assert len(sync.run_id) == 32 and transport.receiver.run_id == sync.run_id
    from rlpost.sync.session import SessionMeta

    with pytest.raises(ValueError, match="run_id"):
        SessionMeta.from_json({**_meta(1).to_json(), "run_id": "x" * 65})
