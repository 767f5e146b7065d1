"""The gloo sync channel between real processes on 127.0.0.1 (spawned, CPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import torch

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
    cfg = SyncConfig(channel="gloo", codec="bf16", delta=True, bucket_mb=0.01, timeout_s=TIMEOUT_S)
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
