"""The http sync channel against real `rlpost serve` processes: codecs, delta, faults."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from rlpost.config import SyncConfig
from rlpost.models.loading import load_causal_lm, load_tokenizer
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.sync import DeltaRefused, SyncError, build_weight_sync
from rlpost.sync.codecs import encode
from rlpost.sync.session import BucketPacker, SessionMeta, checksum
from rlpost.sync.transports import HttpTransport, TransportOptions
from tests.conftest import ADMIN_HEADERS
from tests.integration.test_server import start_server, stop_server

BUCKET_MB = 0.005  # ~5 kB: the tiny model streams as many buckets


@pytest.fixture(scope="module")
def servers(tiny_dir):
    started: dict[str, tuple] = {}

    def launch(name):
        started[name] = start_server(tiny_dir, "--threads", "1")

    threads = [threading.Thread(target=launch, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield started
    for proc, _ in started.values():
        stop_server(proc)


def _weights(tiny_dir, seed: int) -> dict[str, torch.Tensor]:
    model = load_causal_lm(tiny_dir)
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        for n, p in model.named_parameters()
    }


def _served_version(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["policy_version"]


def test_each_codec_and_delta_reach_the_server_verified(servers, tiny_dir):
    url = servers["a"][1]
    w = _weights(tiny_dir, 0)
    sizes = {}
    for version, codec in enumerate(["none", "bf16", "fp8", "mxfp4"], start=1):
        sync = build_weight_sync(
            SyncConfig(channel="http", codec=codec, bucket_mb=BUCKET_MB),
            [url],
            headers=ADMIN_HEADERS,
        )
        stats = sync.push(w.items(), version)  # verify is on: a wrong tensor would raise
        assert stats.committed == [url] and stats.buckets > 1 and _served_version(url) == version
        sizes[codec] = stats.bytes
        sync.close()
    assert sizes["bf16"] == sizes["none"] / 2 and sizes["mxfp4"] < sizes["fp8"] < sizes["bf16"]
    sync = build_weight_sync(
        SyncConfig(channel="http", codec={"name": "bf16", "delta": True}, bucket_mb=BUCKET_MB),
        [url],
        headers=ADMIN_HEADERS,
    )
    full = sync.push(w.items(), 5)
    stepped = {k: v - 1e-6 * torch.sign(v) for k, v in w.items()}
    delta = sync.push(stepped.items(), 6)
    assert delta.delta_tensors == len(w) and delta.bytes < 0.1 * full.bytes
    state = httpx.get(f"{url}/v1/sync/state", headers=ADMIN_HEADERS, timeout=10).json()
    assert state == {"version": 6, "base_version": 6, "in_session": False}
    sync.close()


def test_corrupted_bucket_and_wrong_delta_base_are_refused(servers, tiny_dir):
    url = servers["b"][1]
    before = _served_version(url)
    t = HttpTransport(url, TransportOptions(timeout_s=30, headers=ADMIN_HEADERS))
    with pytest.raises(DeltaRefused, match="delta against version 99 refused"):
        t.start(SessionMeta.new(before + 1, "bf16", 4096, True, 99))
    meta = SessionMeta.new(before + 1, "bf16", 4096, False, None)
    packer = BucketPacker(meta.session, 4096)
    enc = encode("model.norm.weight", torch.ones(32), "bf16")
    t.start(meta)
    (bucket,) = list(packer.add("model.norm.weight", enc, checksum(enc.parts["data"]))) + list(
        packer.flush()
    )
    bucket.payload[3] ^= 0x55
    with pytest.raises(SyncError) as info:
        t.update(bucket)
    assert "weight sync update on " + url in str(info.value) and "CRC" in str(info.value)
    assert "\n" not in str(info.value)
    assert _served_version(url) == before
    t.close()


def test_server_killed_mid_push_fails_over_and_the_restarted_one_gets_a_full_sync(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    procs = {n: start_server(tiny_dir, "--threads", "1") for n in ("a", "b")}
    urls = [procs[n][1] for n in ("a", "b")]
    cfg = SyncConfig(channel="http", codec={"name": "bf16", "delta": True}, bucket_mb=BUCKET_MB)
    sync = build_weight_sync(cfg, urls, headers=ADMIN_HEADERS)
    engine = RemoteEngine(urls, tok, weight_sync=sync)
    try:
        w = _weights(tiny_dir, 1)
        engine.load_weights(w.items(), 1)

        def killing(tensors):  # the server dies after some buckets went out
            for i, item in enumerate(tensors):
                if i == 3:
                    procs["a"][0].kill()
                    procs["a"][0].wait()
                yield item

        stepped = {k: v + 1e-6 * torch.sign(v) for k, v in w.items()}
        engine.load_weights(killing(stepped.items()), 2)
        stats = engine.last_sync
        assert stats.committed == [urls[1]] and list(stats.failed) == [urls[0]]
        assert "\n" not in stats.failed[urls[0]] and urls[0] in stats.failed[urls[0]]
        servers = engine.balancer.stats()["servers"]
        assert not servers[urls[0]]["up"] and servers[urls[1]]["up"]
        params = SamplingParams(temperature=1.0, max_tokens=4)
        out = engine.generate([tok("1+1=", add_special_tokens=False)["input_ids"]], params, n=2)
        assert {c.policy_version for c in out} == {2}
        # Restarted on the same port, the server has no base: it refuses the delta, gets it whole.
        port = urls[0].rsplit(":", 1)[1]
        procs["a"] = start_server(tiny_dir, "--threads", "1", "--port", port)
        engine.load_weights(stepped.items(), 3)
        assert not engine.last_sync.failed and sorted(engine.last_sync.committed) == sorted(urls)
        assert [_served_version(u) for u in urls] == [3, 3]
        assert engine.balancer.stats()["servers"][urls[0]]["up"]
    finally:
        engine.close()
        for proc, _ in procs.values():
            stop_server(proc)


def test_the_only_server_killed_mid_push_is_a_one_line_error(tiny_dir):
    proc, url = start_server(tiny_dir, "--threads", "1")
    sync = build_weight_sync(
        SyncConfig(channel="http", codec="bf16", bucket_mb=BUCKET_MB, timeout_s=20),
        [url],
        headers=ADMIN_HEADERS,
    )
    w = _weights(tiny_dir, 2)

    def killing(tensors):
        for i, item in enumerate(tensors):
            if i == 2:
                proc.kill()
                proc.wait()
            yield item

    with pytest.raises(SyncError) as info:
        sync.push(killing(w.items()), 1)
    msg = str(info.value)
    assert "\n" not in msg and f"weight sync update on {url}" in msg
    sync.close()
    stop_server(proc)


def test_a_raw_tensor_of_another_dtype_is_refused_and_a_codec_casts(servers, tiny_dir):
    """codec=none sends tensors as they are: one the served model would have to cast is a 400
    naming it, and the server keeps serving its weights; bf16 and fp8 decode to its dtype."""
    url = servers["b"][1]
    w = _weights(tiny_dir, 3)
    before = _served_version(url)
    probe = {"prompt": "1+1=", "max_tokens": 4, "temperature": 0.0, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=probe, timeout=30).json()["choices"]
    sync = build_weight_sync(
        SyncConfig(channel="http", codec="none", bucket_mb=BUCKET_MB), [url], headers=ADMIN_HEADERS
    )
    name = "model.norm.weight"
    with pytest.raises(SyncError) as info:
        sync.push({**w, name: w[name].double()}.items(), before + 1)
    msg = str(info.value)
    assert "\n" not in msg and "HTTP 400" in msg, msg
    assert f"tensor {name!r} has dtype torch.float64, not torch.float32" in msg
    assert _served_version(url) == before  # nothing applied: the same answer, token for token
    assert httpx.post(f"{url}/v1/completions", json=probe, timeout=30).json()["choices"] == answer
    sync.close()
    for version, codec in enumerate(["bf16", "fp8"], start=before + 1):
        sync = build_weight_sync(
            SyncConfig(channel="http", codec=codec, bucket_mb=BUCKET_MB),
            [url],
            headers=ADMIN_HEADERS,
        )
        assert sync.push(w.items(), version).committed == [url] and _served_version(url) == version
        sync.close()
