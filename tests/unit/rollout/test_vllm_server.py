"""The weight push into ``vllm serve`` (CPU, no vLLM): a server without the development
routes is refused in one line naming how to start it, and no weight file is left behind."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlpost.rollout.engines.vllm_server import VLLMServerSync, serve_args
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
