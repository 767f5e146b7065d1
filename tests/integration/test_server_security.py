"""`rlpost serve` off loopback: keys, the admin guard, weight checks, limits, slow clients.

Every server here is a real process on 127.0.0.1; the non-loopback refusal runs
in a network namespace of its own (only ``lo`` and a dummy interface).
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from rlpost.config import SyncConfig
from rlpost.models.loading import load_causal_lm
from rlpost.sync import SyncError, build_weight_sync
from tests.integration.test_server import start_server, stop_server

API, ADMIN = "inference-key-123", "admin-key-456"
KEYS = {"RLPOST_API_KEY": API, "RLPOST_ADMIN_KEY": ADMIN}
EXTRA_ROUTES = """
import sys
from fastapi import APIRouter
from rlpost.rollout.serve.server import main

router = APIRouter()
router.post("/open")(lambda: {"session": 1})
router.get("/deeper/status")(lambda: {"state": "idle"})
sys.exit(main(sys.argv[1:], routers={"/v1/sync": router}))
"""


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("secure")
    script = root / "serve_with_sync.py"
    script.write_text(EXTRA_ROUTES)
    flags = ["--max-body-mb", "1", "--max-pending", "2"]
    flags += ["--max-request-sequences", "2", "--header-timeout", "1", "--request-timeout", "4"]
    flags += ["--body-timeout", "4"]
    proc, url = start_server(tiny_dir, *flags, env=KEYS, entry=[str(script)])
    yield {"url": url, "root": root, "model": tiny_dir}
    stop_server(proc)


def _post(url, path, key=None, **kwargs):
    return httpx.post(f"{url}{path}", headers=auth(key) if key else {}, timeout=60, **kwargs)


def test_inference_needs_the_api_key(keyed):
    url, body = keyed["url"], {"prompt": "1+", "max_tokens": 2}
    assert _post(url, "/v1/completions", json=body).status_code == 401
    wrong = _post(url, "/v1/completions", "x" * len(API), json=body)
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert API not in wrong.text and ADMIN not in wrong.text
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert _post(url, "/v1/completions", API, json=body).status_code == 200
    assert _post(url, "/v1/completions", ADMIN, json=body).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # open, for load balancers


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/sync/open"), ("GET", "/v1/sync/deeper/status")],
)
def test_control_routes_need_the_admin_key(keyed, method, path):
    url = keyed["url"]
    assert httpx.request(method, f"{url}{path}").status_code == 401
    inference = httpx.request(method, f"{url}{path}", headers=auth(API))
    assert inference.status_code == 403 and "admin key" in inference.json()["error"]["message"]
    admin = httpx.request(method, f"{url}{path}", headers=auth(ADMIN), json={})
    assert admin.status_code == 200  # through the guard


def test_weights_are_checked_before_anything_is_applied(keyed):
    url = keyed["url"]
    state = load_causal_lm(keyed["model"]).state_dict()
    name = next(k for k, v in state.items() if v.is_floating_point())
    version = httpx.get(f"{url}/health").json()["policy_version"]
    bad = [
        {name: torch.zeros(3, 3)},  # wrong shape
        {"not.a.weight": torch.zeros(2)},  # unknown name
    ]
    sync = build_weight_sync(SyncConfig(channel="http"), [url], headers=auth(ADMIN))
    for tensors in bad:
        with pytest.raises(SyncError):
            sync.push(tensors.items(), 99)
    sync.close()
    assert httpx.get(f"{url}/health").json()["policy_version"] == version


def _raw(url: str, head: bytes, timeout: float = 30.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(head)
    return sock


def _head(path: str, length: int, key: str | None = API) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] + ([f"Authorization: Bearer {key}"] if key else [])
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split()[1]) if data else 0


def test_a_200mb_body_is_refused_from_its_headers(keyed):
    url = keyed["url"]
    rss = _server_rss(url)
    for key, status in ((API, 413), (None, 401)):
        sock = _raw(url, _head("/v1/completions", 200 * 1024 * 1024, key))
        assert _status(sock) == status  # answered before a byte of the body was sent
        sock.close()
    assert _chunked_status(url, 64) == 413  # 4 MiB, chunked: no Content-Length to judge by
    assert _server_rss(url) < rss + 50 * 1024 * 1024


def _chunked_status(url: str, chunks: int) -> int:
    """Send a chunked body of 64 KiB chunks until the server answers; its status."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    sock = _raw(url, head + f"Authorization: Bearer {API}\r\n\r\n".encode())
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
    for _ in range(chunks):
        if select.select([sock], [], [], 0.05)[0]:  # the server has answered: stop sending
            break
        sock.sendall(chunk)
    status = _status(sock)
    sock.close()
    return status


def _server_rss(url: str) -> int:
    return int(httpx.get(f"{url}/health").json()["rss_bytes"])


def test_bodies_still_arriving_hold_no_pending_slot(keyed):
    url = keyed["url"]
    # Two requests whose bodies never finish: read before they count, they hold nothing.
    held = [_raw(url, _head("/v1/completions", 100) + b'{"prompt"') for _ in range(2)]
    assert httpx.get(f"{url}/health").json()["http"]["pending"] == 0
    r = _post(url, "/v1/completions", API, json={"prompt": "1", "max_tokens": 2, "n": 2})
    assert r.status_code == 200
    assert [_status(s) for s in held] == [408, 408]  # the body never came: body timeout
    for s in held:
        s.close()
    r = _post(url, "/v1/completions", API, json={"prompt": "1", "max_tokens": 2, "n": 3})
    assert r.status_code == 400 and "--max-request-sequences" in r.json()["error"]["message"]


def test_slow_header_clients_do_not_starve_others(keyed):
    url = keyed["url"]
    trickle = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    slow = [_raw(url, b"P") for _ in range(24)]
    closed: list[bool] = []

    def drip(sock):
        try:
            for byte in trickle[1:]:
                time.sleep(0.1)
                sock.sendall(bytes([byte]))
            closed.append(False)  # sent everything without being cut off
        except OSError:
            closed.append(True)

    threads = [threading.Thread(target=drip, args=(s,), daemon=True) for s in slow]
    for t in threads:
        t.start()
    body = {"prompt": "1+", "max_tokens": 4}
    codes = [_post(url, "/v1/completions", API, json=body).status_code for _ in range(20)]
    for t in threads:
        t.join(60)
    assert codes == [200] * 20
    assert closed == [True] * len(slow)  # each trickler was cut off by the header timeout
    for s in slow:
        s.close()


def test_an_accepted_body_must_arrive_within_the_body_timeout(keyed):
    """A body trickled byte by byte is cut at --body-timeout in all, not per byte."""
    sock = _raw(keyed["url"], _head("/v1/completions", 1000) + b"{")
    for _ in range(300):  # up to 30 s of one byte every 0.1 s; the body timeout is 4 s
        if select.select([sock], [], [], 0.1)[0]:
            break
        sock.sendall(b" ")
    assert _status(sock) == 408
    sock.close()


def test_a_refused_body_cannot_be_trickled_for_ever(keyed):
    """After a 401 the server reads past the body, but only while it keeps coming."""
    sock = _raw(keyed["url"], _head("/v1/completions", 1000, key=None) + b"{")
    assert _status(sock) == 401
    cut = False
    for _ in range(300):  # up to 30 s of one byte every 0.1 s; the header timeout is 1 s
        time.sleep(0.1)
        try:
            sock.sendall(b" ")
        except OSError:
            cut = True
            break
    sock.close()
    assert cut


# A namespace with only ``lo``, which also carries 10.77.0.1: an address that is not
# loopback by its number, yet reaches nothing outside the namespace.
NETNS_SETUP = "ip link set lo up && ip addr add 10.77.0.1/32 dev lo || exit 3; "
SERVER = [sys.executable, "-m", "rlpost.rollout.serve.server", "--port", "0", "--threads", "1"]
# Start the server in the background, wait for its first line, then stop it.
UNTIL_LISTENING = (
    ' > "$D/out" 2> "$D/err" & p=$!; i=0; '
    'while [ $i -lt 600 ] && ! grep -q listening "$D/out" && kill -0 $p 2>/dev/null; '
    "do sleep 0.1; i=$((i+1)); done; kill $p 2>/dev/null; wait $p"
)


def _in_netns(args: list[str], tmp_path, *, background: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    command = NETNS_SETUP + shlex.join([*SERVER, *args])
    if background:  # the server alone in the background, so $! is its pid
        tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
        command += UNTIL_LISTENING
        env["D"] = str(tmp_path)
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=300
    )
    if background:
        return (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    return done


def _netns_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "sh", "-c", NETNS_SETUP + "true"], capture_output=True)
    return probe.returncode == 0


netns = pytest.mark.skipif(not _netns_available(), reason="needs root and network namespaces")


@netns
@pytest.mark.parametrize("host", ["0.0.0.0", "10.77.0.1", "::"])
def test_non_loopback_bind_without_keys_is_refused(host, tmp_path):
    refused = _in_netns(["--host", host], tmp_path)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and refused.stdout == ""
    assert "--api-key" in lines[0] and "--admin-key" in lines[0] and "--insecure" in lines[0]
    half = _in_netns(["--host", host, "--api-key", API], tmp_path)
    assert half.returncode == 2 and "--admin-key" in half.stderr and "--api-key" not in half.stderr


@netns
def test_non_loopback_bind_with_keys_or_insecure(tmp_path):
    out, err = _in_netns(
        ["--host", "10.77.0.1", "--api-key", API, "--admin-key", ADMIN], tmp_path, background=True
    )
    assert "listening on http://10.77.0.1:" in out and "warning" not in err
    out, err = _in_netns(["--host", "10.77.0.1", "--insecure"], tmp_path, background=True)
    assert "listening on http://10.77.0.1:" in out and "warning: --insecure" in err
    same = _in_netns(["--api-key", API, "--admin-key", API], tmp_path)
    assert same.returncode == 2 and "must differ" in same.stderr


def test_remote_engine_sends_keys_read_from_the_environment(keyed, monkeypatch):
    from types import SimpleNamespace

    from rlpost.config import RolloutConfig, SyncConfig
    from rlpost.models.loading import load_tokenizer
    from rlpost.rollout.engines import remote as remote_engine
    from rlpost.rollout.engines.client import RequestRejected
    from rlpost.rollout.engines.protocol import SamplingParams

    tok, url = load_tokenizer(keyed["model"]), keyed["url"]
    params, prompts = SamplingParams(max_tokens=3), [[5, 6, 7]]
    monkeypatch.setenv("MY_ROLLOUT_KEY", API)
    monkeypatch.setenv("MY_ADMIN_KEY", ADMIN)
    engine = {"name": "remote", "servers": [url]}
    rollout = RolloutConfig(
        engine={**engine, "api_key_env": "MY_ROLLOUT_KEY", "admin_key_env": "MY_ADMIN_KEY"}
    )
    run = SimpleNamespace(rollout=rollout, run=SimpleNamespace(seed=0), sync=SyncConfig())
    engine = remote_engine.build(run, None, None, tok)
    assert API not in repr(engine.clients) and len(engine.generate(prompts, params, n=2)) == 2
    engine.load_weights(load_causal_lm(keyed["model"]).named_parameters(), version=7)
    assert engine.generate(prompts, params)[0].policy_version == 7
    engine.close()
    monkeypatch.delenv("MY_ROLLOUT_KEY")
    keyless = remote_engine.build(run, None, None, tok)
    with pytest.raises(RequestRejected, match="401"):
        keyless.generate(prompts, params)
    keyless.close()
