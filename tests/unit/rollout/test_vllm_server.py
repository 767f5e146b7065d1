"""The weight push into ``vllm serve`` and the loader its workers run (CPU, no vLLM): a server
without the development routes is refused in one line naming how to start it, no weight file
is left behind, and the loader takes only signed pushes from the trainer's address whose
tensors are the model's, reading no more than the model's size."""

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
from safetensors.torch import save, save_file

from rlpost.config import ConfigError
from rlpost.rollout.engines.vllm_server import VLLMServerSync, WeightFiles, serve_args
from rlpost.rollout.engines.vllm_worker import (
    FROM_ENV,
    KEY_ENV,
    WeightsRefused,
    check_source,
    read_weights,
    sign,
)
from rlpost.sync import SyncError

KEY = "k" * 64
SERVED = {KEY_ENV: KEY, FROM_ENV: "127.0.0.1"}  # a vllm serve started as docs/rollout.md says
MODEL = {"a": (2, 3), "b": (4,)}  # the served checkpoint's tensors


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
    sync = VLLMServerSync([plain_server], key=KEY)
    sync.weights_dir = tmp_path
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
    worker extension's checks and reader on what it is given, as each worker does."""

    seen: ClassVar[list] = []
    env: ClassVar[dict] = SERVED  # the loader's environment, and the served model's tensors
    model: ClassVar[dict] = MODEL
    seeds: ClassVar[list] = [[False]]  # what rlpost_serves_seeds answers: a CPU build's
    bodies: ClassVar[list] = []  # of /v1/completions

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        answer = b"{}"
        if self.path == "/v1/completions":
            self.bodies.append(json.loads(body))
            choice = {"text": "x", "token_ids": [7], "finish_reason": "stop",
                      "logprobs": {"token_logprobs": [-0.5]}}  # fmt: skip
            answer = json.dumps({"choices": [choice]}).encode()
        elif self.path == "/collective_rpc" and b"rlpost_serves_seeds" in body:
            answer = json.dumps({"results": self.seeds}).encode()
        elif self.path == "/collective_rpc":
            source, version, token = json.loads(body)["args"]
            try:
                check_source(source, version, token, self.env)
                weights = read_weights(source, self.model)
                self.seen.append((source, weights))
                answer = json.dumps({"results": [[int(version), len(weights)]]}).encode()
            except WeightsRefused as exc:  # as rlpost_load_weights answers it
                answer = json.dumps({"results": [["refused", str(exc)]]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        """Silent."""


@pytest.fixture
def dev_server():
    _DevRoutes.seen, _DevRoutes.bodies, _DevRoutes.seeds = [], [], [[False]]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DevRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_every_server_pulls_the_signed_weights_over_http(dev_server, tmp_path):
    """The server is given a URL on the trainer's address, never a path; it reads the
    pushed tensors there, and nothing listens there once the push is over (the trainer
    listens during a push)."""
    tensors = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4))]
    sync = VLLMServerSync([dev_server], key=KEY)
    sync.weights_dir = tmp_path
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


@pytest.mark.parametrize(
    "answer, seeds", [([[True]], True), ([[False]], False), ([[True], [False]], False)]
)
def test_a_build_without_per_request_seeds_is_sent_none(dev_server, answer, seeds):
    """vLLM's CPU build dies on a seeded request after a chunked prefill: a server whose
    workers do not all say they take seeds gets requests without one."""
    from rlpost.models.tiny import build_char_tokenizer
    from rlpost.rollout.engines.protocol import SamplingParams
    from rlpost.rollout.engines.remote import RemoteEngine

    _DevRoutes.seeds = answer
    sync = VLLMServerSync([dev_server], key=KEY)
    engine = RemoteEngine([dev_server], build_char_tokenizer(), seedless=sync.seedless())
    try:
        engine.generate([[1, 2]], SamplingParams(max_tokens=1, seed=5))
    finally:
        engine.close()
        sync.close()
    assert _DevRoutes.bodies[-1].get("seed") == (5 if seeds else None)


def test_a_server_that_cannot_say_is_sent_no_seeds(plain_server):
    sync = VLLMServerSync([plain_server], key=KEY)
    assert sync.seedless() == [plain_server]
    sync.close()


def test_a_push_signed_with_another_key_is_refused_by_the_server(dev_server):
    sync = VLLMServerSync([dev_server], key="another key")
    with pytest.raises(SyncError, match="token does not match") as err:
        sync.push([("a", torch.ones(2, 3))], version=1)
    sync.close()
    assert "\n" not in str(err.value) and _DevRoutes.seen == []


def test_a_push_without_the_admin_key_is_refused_in_one_line(monkeypatch):
    from rlpost.config import load_config
    from rlpost.rollout.engines.vllm_server import build_sync

    monkeypatch.delenv("RLPOST_ADMIN_KEY", raising=False)
    cfg = load_config(None, ["rollout.engine=remote", "rollout.engine.server=vllm",
                             'rollout.engine.servers=["http://127.0.0.1:8000"]'])  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"rollout\.engine\.admin_key_env=RLPOST_ADMIN_KEY"
    ) as err:
        build_sync(cfg)
    assert "\n" not in str(err.value) and KEY_ENV in str(err.value)


def test_a_server_off_loopback_is_offered_the_file_on_the_address_facing_it():
    try:
        remote = VLLMServerSync(["http://10.254.0.9:8000"], key=KEY)
    except SyncError:
        pytest.skip("no route off loopback on this machine")
    try:
        files = remote.files["http://10.254.0.9:8000"]
        assert not files.host.startswith("127.")
        assert files.httpd is None  # nothing listens until a push offers a file
    finally:
        remote.close()


def test_a_server_no_route_reaches_is_refused_in_one_line():
    with pytest.raises(SyncError) as err:
        VLLMServerSync(["http://no-such-host.invalid:8000"], key=KEY)
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


# ------------------------------------------------------------------ the loader's checks


@pytest.fixture
def trainer(tmp_path):
    """The trainer's weight server on loopback: ``offer(payload) -> (url, its token)``."""
    files = WeightFiles("127.0.0.1")

    def offer(payload: bytes, version: int = 1) -> tuple[str, str]:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(payload)
        url = files.offer(path.stem, path)
        return url, sign(KEY, url, version)

    yield offer
    files.close()


def _weights(**tensors) -> bytes:
    return save({"a": torch.zeros(2, 3), "b": torch.ones(4), **tensors})


def _raw(entries: dict, data: int) -> bytes:
    """A safetensors file written by hand: ``name: [dtype, shape, offsets]``, ``data`` bytes."""
    header = json.dumps(
        {n: {"dtype": d, "shape": s, "data_offsets": o} for n, (d, s, o) in entries.items()}
    ).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * data


def _load(url, token, env=SERVED, version=1):
    check_source(url, version, token, env)
    return dict(read_weights(url, MODEL))


def test_the_loader_takes_a_signed_push_from_the_trainers_address(trainer):
    url, token = trainer(_weights())
    got = _load(url, token)
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], torch.ones(4))
    url, token = trainer(save({"a": torch.zeros(2, 3, dtype=torch.bfloat16)}))
    assert list(_load(url, token)) == ["a"]  # a bf16 trainer, part of the model


@pytest.mark.parametrize(
    "env, token, why",
    [
        ({FROM_ENV: "127.0.0.1"}, None, f"{KEY_ENV} is not set"),
        (SERVED, "", "token does not match"),
        (SERVED, "0" * 64, "token does not match"),
        ({KEY_ENV: "another", FROM_ENV: "127.0.0.1"}, None, "token does not match"),
        ({KEY_ENV: KEY, FROM_ENV: "10.0.0.7"}, None, "not on the trainer's address"),
        ({KEY_ENV: KEY}, None, "is a URL and RLPOST_WEIGHTS_FROM"),
    ],
    ids=["no-key", "no-token", "wrong-token", "other-key", "other-address", "not-served"],
)
def test_the_loader_refuses_a_push_it_cannot_trust(trainer, env, token, why):
    url, signed = trainer(_weights())
    with pytest.raises(WeightsRefused, match=why) as err:
        _load(url, signed if token is None else token, env)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "source",
    ["http://169.254.169.254/latest/meta-data", "http://127.0.0.2:8000/x", "/etc/passwd",
     "file:///etc/passwd", "https://127.0.0.1/x"],
)  # fmt: skip
def test_a_served_loader_fetches_nothing_but_the_trainers_address_over_http(source):
    """Blind SSRF and local files: even signed, a served loader reads only the trainer's
    address over http, and an unsigned call is refused before anything is read."""
    with pytest.raises(WeightsRefused, match="token does not match"):
        check_source(source, 1, "", SERVED)
    with pytest.raises(WeightsRefused, match="not on the trainer's address"):
        check_source(source, 1, sign(KEY, source, 1), SERVED)


def test_a_token_is_for_one_url_and_one_version(trainer):
    url, token = trainer(_weights(), version=1)
    with pytest.raises(WeightsRefused, match="token does not match"):
        _load(url, token, version=2)
    with pytest.raises(WeightsRefused, match="token does not match"):
        _load(url + "x", token)


@pytest.mark.parametrize(
    "payload, why",
    [
        (_weights(c=torch.ones(2)), "'c' is not a tensor of the model"),
        (save({"a": torch.zeros(3, 2)}), r"a is F32\[3, 2\], the model's is \[2, 3\]"),
        (save({"a": torch.zeros(2, 3, dtype=torch.int64)}), "a is I64"),
        (_weights() + b"\0" * (1 << 20), "runs past the tensors its header lists"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "more than 2 tensors take"),
        (b"\x10" + b"\0" * 7 + b"[not a header]\0\0", "not a safetensors header"),
        (_weights()[:-4], "ends 4 bytes early"),
        (_raw({"a": ["F32", [2, 3], ["0", "24"]]}, 24), "not a safetensors header"),
        (
            _raw({"a": ["F32", [2, 3], [0, 24]], "b": ["F32", [4], [0, 16]]}, 24),
            "not a safetensors file",
        ),
    ],
    ids=[
        "name",
        "shape",
        "dtype",
        "over-cap",
        "huge-header",
        "garbage",
        "short",
        "offset-text",
        "overlap",
    ],
)
def test_the_loader_refuses_tensors_that_are_not_the_models(trainer, payload, why):
    url, token = trainer(payload)
    with pytest.raises(WeightsRefused, match=why) as err:
        _load(url, token)
    assert "\n" not in str(err.value)


def test_an_offset_past_the_models_size_is_refused_before_reading(trainer):
    url, token = trainer(_raw({"a": ["F32", [2, 3], [1 << 40, (1 << 40) + 24]]}, 0))
    with pytest.raises(WeightsRefused, match="bytes of tensors, the model's take 40"):
        _load(url, token)


def test_an_in_process_loader_reads_only_signed_files(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.zeros(2, 3)}, path)
    env = {KEY_ENV: KEY}
    check_source(path, 2, sign(KEY, path, 2), env)
    assert list(dict(read_weights(path, MODEL))) == ["a"]
    with pytest.raises(WeightsRefused, match="token does not match"):
        check_source("/etc/shadow", 2, "", env)


def test_the_worker_answers_a_refusal_and_checks_the_served_checkpoint(
    trainer, tiny_dir, monkeypatch
):
    """``rlpost_load_weights`` as vLLM's route calls it (strings): a refusal is an answer
    naming why, not an error (vLLM's route would turn that into a bare 500), and the tensors
    are checked against the checkpoint the server was started with."""
    from types import SimpleNamespace

    from rlpost.rollout.engines.vllm_worker import WeightLoader, checkpoint_tensors

    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv(FROM_ENV, "127.0.0.1")
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(tiny_dir)))
    worker = SimpleNamespace(vllm_config=config)
    shapes = checkpoint_tensors(str(tiny_dir))
    name, shape = next(iter(shapes.items()))
    url, token = trainer(save({name: torch.zeros((*shape[::-1], 2))}))
    answer = WeightLoader.rlpost_load_weights(worker, url, "1", token)
    assert answer[0] == "refused" and f"weights refused: {name} is F32" in answer[1]
    url, _ = trainer(save({name: torch.zeros(shape)}))
    assert WeightLoader.rlpost_load_weights(worker, url, "1", "")[1].endswith(
        f"the push's token does not match {KEY_ENV}"
    )
    gone = url.rsplit("/", 1)[0] + "/gone"
    answer = WeightLoader.rlpost_load_weights(worker, gone, "1", sign(KEY, gone, 1))
    assert answer[0] == "refused" and "404" in answer[1]
