"""The gloo sync channel between real processes on 127.0.0.1 (spawned, CPU)."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from rlpost.config import SyncConfig
from rlpost.sync import SyncError, build_weight_sync
from rlpost.sync.codecs import encode
from rlpost.sync.gloo import GlooLink, GlooTransport, serve_gloo
from rlpost.sync.session import BucketPacker, SessionMeta, checksum
from tests.unit.sync.engines import DictEngine, toy_weights

TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(link: GlooLink, rank: int, out: str) -> None:
    """A receiving process: serve until the sender closes or goes away, then save what it serves."""
    torch.set_num_threads(1)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in toy_weights().items()})
    try:
        serve_gloo(engine, link, rank, timeout_s=TIMEOUT_S)
        status = "closed"
    except SyncError as exc:
        status = str(exc)
    torch.save({"version": engine.version, "weights": engine.weights, "status": status}, out)


def _receive_logging(link: GlooLink, rank: int, out: str, log: str) -> None:
    logging.basicConfig(filename=log, level=logging.WARNING, format="%(message)s", force=True)
    _receive(link, rank, out)


def _send_then_die(link: GlooLink) -> None:
    """A sending process that pushes version 1, then dies after two buckets of version 2."""
    torch.set_num_threads(1)
    sync = build_weight_sync(SyncConfig(channel="gloo", codec="bf16", bucket_mb=0.01), [link])
    sync.push(toy_weights(0).items(), 1)
    t: GlooTransport = sync.transports[0]
    meta = SessionMeta.new(2, "bf16", 10240, False, None)
    t.start(meta)
    packer = BucketPacker(meta.session, 10240)
    sent = 0
    for name, w in toy_weights(1).items():
        enc = encode(name, w, "bf16")
        for bucket in packer.add(name, enc, checksum(enc.parts["data"])):
            t.update(bucket)
            sent += 1
            if sent == 2:
                os._exit(1)  # no finish, no close: the process is simply gone


def _spawn(target, *args):
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    return p


def test_two_receiving_processes_get_full_then_delta_versions(tmp_path):
    link = GlooLink("127.0.0.1", _free_port(), world_size=3)
    outs = [str(tmp_path / f"r{r}.pt") for r in (1, 2)]
    procs = [_spawn(_receive, link, r, outs[r - 1]) for r in (1, 2)]
    cfg = SyncConfig(
        channel="gloo", codec={"name": "bf16", "delta": True}, bucket_mb=0.01, timeout_s=TIMEOUT_S
    )
    sync = build_weight_sync(cfg, [link])
    w = toy_weights(0)
    full = sync.push(w.items(), 1)
    time.sleep(2.5)  # the receivers wait idle for longer than their poll interval
    stepped = {k: v - 1e-6 * torch.sign(v) for k, v in w.items()}
    delta = sync.push(stepped.items(), 2)
    sync.close()
    for p in procs:
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
    assert full.buckets > 2 and delta.delta_tensors == len(w) and delta.bytes < 0.1 * full.bytes
    for out in outs:
        got = torch.load(out)
        assert got["status"] == "closed" and got["version"] == 2
        for k, v in stepped.items():
            assert torch.equal(got["weights"][k], v.to(torch.bfloat16).float())


def test_a_sender_dying_mid_session_leaves_the_receiver_on_the_old_version(tmp_path):
    link = GlooLink("127.0.0.1", _free_port(), world_size=2)
    out = str(tmp_path / "r1.pt")
    receiver = _spawn(_receive, link, 1, out)
    sender = _spawn(_send_then_die, link)
    sender.join(TIMEOUT_S)
    receiver.join(TIMEOUT_S)
    assert sender.exitcode == 1 and receiver.exitcode == 0
    got = torch.load(out)
    assert got["version"] == 1 and "sender gone" in got["status"] and "\n" not in got["status"]
    for k, v in toy_weights(0).items():
        assert torch.equal(got["weights"][k], v.to(torch.bfloat16).float())


def _refusals(log) -> list[str]:
    return [x for x in log.read_text().splitlines() if "refused a forged message" in x]


def test_forged_store_messages_are_refused_and_the_receiver_serves_on(tmp_path):
    """Anyone who reaches the store can write its keys: a payload size of 10^13, an unknown
    bucket header key and a close, written where the receiver reads next, are each refused
    in one log line; the sender's own session then commits and its close ends the loop."""
    link = GlooLink("127.0.0.1", _free_port(), world_size=2)
    out, log = str(tmp_path / "r1.pt"), tmp_path / "r1.log"
    log.touch()
    proc = _spawn(_receive_logging, link, 1, out, str(log))
    cfg = SyncConfig(channel="gloo", codec="bf16", bucket_mb=0.01, timeout_s=TIMEOUT_S)
    sync = build_weight_sync(cfg, [link])
    stranger = dist.TCPStore(link.host, link.port, None, False, timedelta(seconds=TIMEOUT_S))
    header = {"session": "s", "index": 0, "entries": [], "crc": 0, "run": "x"}
    forged = [
        json.dumps({"op": "update", "header": header, "size": 10**13}),  # unsigned
        "0" * 64 + "\n" + json.dumps({"op": "update", "header": header, "size": 8}),  # bad mac
        json.dumps({"op": "close"}),
    ]
    for k, value in enumerate(forged, start=1):
        stranger.set("msg/1", value)
        deadline = time.monotonic() + TIMEOUT_S
        while len(_refusals(log)) < k and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_refusals(log)) == k, log.read_text()
    assert proc.is_alive()  # the forged close did not end the loop
    w = toy_weights(0)
    report = sync.push(w.items(), 1)
    sync.close()
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 0 and report.version == 1
    got = torch.load(out)
    assert got["status"] == "closed" and got["version"] == 1
    for k, v in w.items():
        assert torch.equal(got["weights"][k], v.to(torch.bfloat16).float())
    lines = _refusals(log)
    assert all("msg/1" in x and "signature" in x for x in lines), lines


def test_a_signed_message_is_refused_when_its_size_exceeds_the_bucket_size():
    from rlpost.sync.gloo import _refusal, _sign, _verify

    key = os.urandom(32)
    raw = _sign(key, "msg/4", json.dumps({"op": "update", "size": 10**13})).encode()
    msg = _verify(key, "msg/4", raw)
    assert "exceeds the session's bucket_bytes 10240" in _refusal(msg, 10240)
    assert _refusal({"op": "update", "size": 100}, 10240) is None
    assert "unknown op" in _refusal({"op": "shutdown"}, 10240)
    for bad in (
        _sign(key, "msg/5", "{}").encode(),
        b"no newline",
        _sign(os.urandom(32), "msg/4", "{}").encode(),
    ):
        try:
            _verify(key, "msg/4", bad)
        except ValueError as exc:
            assert "signature" in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError("a forged value was accepted")


def test_a_bucket_header_with_an_unknown_key_is_an_error_reported_at_finish():
    from rlpost.sync.gloo import _update
    from rlpost.sync.receiver import Receiver

    receiver = Receiver(DictEngine(dict(toy_weights())), name="r")
    receiver.start(SessionMeta.new(1, "bf16", 64, False, None))
    header = {"session": "s", "index": 0, "entries": [], "crc": 0, "run": "x"}
    error = _update(receiver, {"header": header}, torch.zeros(8, dtype=torch.uint8))
    assert "bad bucket header" in error and "'run'" in error and "\n" not in error
    assert not receiver.in_session  # the session is dropped; the engine keeps its version
