"""The weight push into ``vllm serve`` (CPU, no vLLM): a server without the development
routes is refused in one line naming how to start it, and no weight file is left behind."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from rlpost.rollout.engines.vllm_server import VLLMServerSync, WeightFiles, serve_args
from rlpost.sync import SyncError


class _NoDevRoutes(BaseHTTPRequestHandler):
    """A server answering 404 to every route, as vllm serve does without dev mode."""

    def do_POST(self):
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"detail": "Not Found"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def plain_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoDevRoutes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_server_without_dev_routes_is_refused_in_one_line(plain_server, tmp_path):
    sync = VLLMServerSync([plain_server], weights_dir=str(tmp_path))
    with pytest.raises(SyncError) as err:
        sync.push([("w", torch.ones(3))], version=1)
    sync.close()
    line = str(err.value)
    assert "\n" not in line
    assert "VLLM_SERVER_DEV_MODE=1" in line and "--worker-extension-cls" in line
    assert list(tmp_path.iterdir()) == []  # the weight file went with the push


def test_serve_args_load_rlpost_worker_extension():
    args = serve_args("/m", port=8000, max_model_len=512)
    assert args[args.index("--worker-extension-cls") + 1] == (
        "rlpost.rollout.engines.vllm_worker.WeightLoader"
    )
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--host") + 1] == "127.0.0.1"


class _DevRoutes(BaseHTTPRequestHandler):
    """vllm serve's development routes as rlpost uses them; ``/collective_rpc`` runs the
    worker extension's reader on what it is given, as each worker does."""

    seen: ClassVar[list] = []

    def do_POST(self):
        from rlpost.rollout.engines.vllm_worker import read_weights

        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        answer = b"{}"
        if self.path.startswith("/collective_rpc"):
            source, version = json.loads(body)["args"]
            weights = read_weights(source)
            self.seen.append((source, weights))
            answer = json.dumps({"results": [[int(version), len(weights)]]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        """Silent."""


@pytest.fixture
def dev_server():
    _DevRoutes.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DevRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_without_the_trainers_filesystem_pulls_the_weights_over_http(dev_server, tmp_path):
    """Pulled: the server is given a URL, not a path; it reads the pushed tensors there,
    and nothing listens there once the push is over (the trainer listens during a push)."""
    tensors = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4))]
    sync = VLLMServerSync([dev_server], weights_dir=str(tmp_path), pull=True)
    try:
        stats = sync.push(tensors, version=3)
        ((source, got),) = _DevRoutes.seen
        assert source.startswith("http://127.0.0.1:") and str(tmp_path) not in source
        assert sorted(n for n, _ in got) == ["a", "b"]
        assert all(torch.equal(t, dict(tensors)[n]) for n, t in got)
        assert stats.committed == [dev_server] and stats.version == 3
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(source, timeout=5)
        assert isinstance(refused.value.reason, ConnectionRefusedError), refused.value
        assert list(tmp_path.iterdir()) == []
    finally:
        sync.close()


def test_loopback_servers_and_a_shared_weights_dir_read_the_file_others_pull(dev_server, tmp_path):
    sync = VLLMServerSync([dev_server], weights_dir=str(tmp_path))
    sync.push([("a", torch.ones(2))], version=1)
    sync.close()
    assert _DevRoutes.seen[0][0].startswith(str(tmp_path))
    try:
        remote = VLLMServerSync(["http://10.254.0.9:8000"])
    except SyncError:
        pytest.skip("no route off loopback on this machine")
    try:
        files = remote.files["http://10.254.0.9:8000"]
        assert files is not None and not files.host.startswith("127.")
        assert files.httpd is None  # nothing listens until a push offers a file
        shared = VLLMServerSync(["http://10.254.0.9:8000"], weights_dir=str(tmp_path))
        assert shared.files["http://10.254.0.9:8000"] is None
        shared.close()
    finally:
        remote.close()


def test_a_server_no_route_reaches_is_refused_in_one_line():
    with pytest.raises(SyncError) as err:
        VLLMServerSync(["http://no-such-host.invalid:8000"])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("weight sync start on http://no-such-host.invalid:8000: no route to ")


def test_idle_connections_to_the_weight_files_are_capped_and_cut_off(tmp_path):
    """200 connections that never send a request hold at most ``max_connections`` threads
    of the trainer, the rest are closed at once, every one is closed by the timeout, and
    the file is served again after."""
    (tmp_path / "w").write_bytes(b"weights")
    files = WeightFiles("127.0.0.1", timeout_s=1.0, max_connections=4)
    before = threading.active_count()
    url = files.offer("token", tmp_path / "w")
    port = int(url.split(":")[2].split("/")[0])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    try:
        time.sleep(0.5)
        held = threading.active_count() - before
        assert held <= 4 + 1, held  # the handlers and the accept loop
        start = time.monotonic()
        assert all(s.recv(1) == b"" for s in idle)  # closed by the server, each one
        assert time.monotonic() - start < 5
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read() == b"weights"
    finally:
        for s in idle:
            s.close()
        files.withdraw("token")
    assert threading.active_count() <= before + 1  # a handler may still be finishing
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
