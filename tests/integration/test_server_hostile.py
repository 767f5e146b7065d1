"""`rlpost serve` against hostile clients: malformed input, stalled readers, slow bodies, huge asks.

Every case is raw HTTP on a socket to a real server process on 127.0.0.1; after
each one the server must still answer ``/health`` and a normal request.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.integration.test_server import start_server, stop_server

ADMIN = "hostile-admin-key"


@pytest.fixture(scope="module")
def hostile(tiny_dir):
    flags = ["--max-tokens-limit", "120", "--max-n", "32", "--max-pending", "40"]
    flags += ["--max-request-sequences", "32", "--max-request-tokens", "70000"]
    flags += ["--body-timeout", "2", "--write-timeout", "2", "--max-score-entries", "7000000"]
    env = {"RLPOST_ADMIN_KEY": ADMIN}
    proc, url = start_server(tiny_dir, *flags, env=env)
    yield url
    stop_server(proc)


def raw_post(
    url: str, path: str, body: bytes, timeout: float = 60.0, headers: dict | None = None
) -> tuple[int, dict]:
    """POST ``body`` as JSON over a bare socket; (status, the answer's JSON)."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(payload) if payload else {}


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "1+", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


COMPLETION = {"prompt": "1+", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NESTED = b"[" * 100_000


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {**COMPLETION, "logit_bias": {"²": 1}}, "logit_bias", "token id"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"9" * 5000: 1}}, "logit_bias", ""),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages",
            "messages[0].content[0]",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "text part",
        ),
        ("/v1/completions", NESTED, None, "nested deeper than 64"),
        ("/v1/chat/completions", b'{"messages": ' + NESTED + b"}", None, "nested deeper"),
        ("/v1/completions", {**COMPLETION, "n": 10**400}, "n", "must be in"),
        ("/v1/completions", {**COMPLETION, "temperature": 10**400}, "temperature", "finite"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": 5}, "stop_token_ids", "list"),
        ("/v1/completions", {**COMPLETION, "prompt": "\ud800"}, "prompt", "lone surrogate"),
        ("/v1/chat/completions", {**CHAT, "\ud800": 1}, "\\ud800", "not supported"),
        ("/v1/completions", {**COMPLETION, "ignore_eos": "false"}, "ignore_eos", "true or false"),
        ("/v1/completions", {**COMPLETION, "user": ["x"]}, "user", "string"),
        ("/v1/completions", b"\xff\xfe{", None, "not valid JSON"),
    ],
)
def test_malformed_input_is_a_4xx_naming_the_field(hostile, path, body, param, says):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = raw_post(hostile, path, raw)
    error = answer["error"]
    assert status == 400 and error["param"] == param, answer
    assert says in error["message"] and "\n" not in error["message"]
    assert len(error["message"]) < 300  # a megabyte of input is not echoed back
    assert_healthy(hostile)


def test_a_keyless_server_keeps_its_control_routes_closed(tiny_dir):
    proc, url = start_server(tiny_dir, env={"RLPOST_ADMIN_KEY": ""})
    try:
        for path in ("/v1/sync/start", "/v1/sync/s/bucket"):
            r = httpx.post(f"{url}{path}", content=b"{}", headers={"authorization": "Bearer x"})
            message = r.json()["error"]["message"]
            assert r.status_code == 403 and "--admin-key" in message and "\n" not in message
        assert httpx.get(f"{url}/v1/sync/state").status_code == 403
        assert httpx.get(f"{url}/health").json()["policy_version"] == 0
        assert_healthy(url)  # generation stays open on loopback
    finally:
        stop_server(proc)


def _open(url: str, path: str, body: bytes, *, rcvbuf: int | None = None, send_all=True):
    """A socket that sent the request head and (``send_all``) its body, never reading."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + (body if send_all else body[:1]))
    return sock


def _http(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()["http"]


def _wait_until(check, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:  # reset: the server aborted the connection; what came before counts
        sock.close()
        return data
    sock.close()
    return data


def test_a_stalled_reader_is_cut_and_its_slots_freed(hostile):
    """A stream of ~10 MB to a client that never reads, through a 4 KiB receive buffer:
    more than every buffer on the way holds, so the server's sends block for good."""
    body = {
        "messages": [{"role": "user", "content": "1+"}],
        "n": 32, "max_tokens": 100, "logprobs": True, "top_logprobs": 20,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    cuts = _http(hostile)["write_timeouts"]
    sock = _open(hostile, "/v1/chat/completions", json.dumps(body).encode(), rcvbuf=4096)
    assert _wait_until(lambda: _http(hostile)["pending"] == 32)
    more = {"prompt": "1+", "max_tokens": 2, "n": 16}
    held = httpx.post(f"{hostile}/v1/completions", json=more, timeout=60)
    if _http(hostile)["pending"] == 32:  # still held when the request came in
        assert held.status_code == 429 and "32 of 40 sequences pending" in held.text
    assert _wait_until(lambda: _http(hostile)["pending"] == 0)  # cut at --write-timeout
    assert _http(hostile)["write_timeouts"] == cuts + 1
    assert httpx.post(f"{hostile}/v1/completions", json=more, timeout=60).status_code == 200
    data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data  # cut mid-stream
    assert httpx.get(f"{hostile}/health").json()["active"] == 0
    assert_healthy(hostile)


def test_a_stalled_readers_samples_leave_the_batch_before_they_are_done(hostile):
    """The same stalled stream: once its response blocks with the client far behind, its
    samples stop decoding (they held batch rows until the write timeout cut it, and
    decoded all 32 x 100 tokens for nobody); the connection is still cut at the timeout."""
    body = {
        "messages": [{"role": "user", "content": "1+"}],
        "n": 32, "max_tokens": 100, "logprobs": True, "top_logprobs": 20,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    before = httpx.get(f"{hostile}/health", timeout=30).json()
    sock = _open(hostile, "/v1/chat/completions", json.dumps(body).encode(), rcvbuf=4096)
    fell = before["http"]["fell_behind"]
    assert _wait_until(lambda: _http(hostile)["fell_behind"] == fell + 1)
    assert _wait_until(lambda: _http(hostile)["pending"] == 0)  # cut at --write-timeout
    after = httpx.get(f"{hostile}/health", timeout=30).json()
    assert after["active"] == 0 and after["http"]["write_timeouts"] > 0
    assert after["tokens"] - before["tokens"] < 32 * 100
    data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data
    assert_healthy(hostile)


def test_slow_bodies_hold_no_pending_slot(hostile):
    body = json.dumps({"prompt": "1+", "max_tokens": 2}).encode()
    slow = [_open(hostile, "/v1/completions", body, send_all=False) for _ in range(8)]
    assert _http(hostile)["pending"] == 0
    ok = [httpx.post(f"{hostile}/v1/completions", content=body, timeout=60) for _ in range(4)]
    assert [r.status_code for r in ok] == [200] * 4
    answers = [_read_all(s) for s in slow]  # cut at --body-timeout (2 s)
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
    assert b"not received within 2.0 s" in answers[0]
    assert _http(hostile)["pending"] == 0
    assert_healthy(hostile)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": ["1", "2"], "n": 17, "max_tokens": 2}, "n", "--max-request-sequences"),
        (
            {"prompt": "1+", "n": 32, "max_tokens": 110, "logprobs": 20},
            "max_tokens",
            "73920 token entries; this server takes at most 70000",
        ),
    ],
)
def test_a_request_over_the_work_cap_is_a_400_naming_the_limit(hostile, body, param, says):
    status, answer = raw_post(hostile, "/v1/completions", json.dumps(body).encode())
    assert (
        status == 400 and answer["error"]["param"] == param and says in answer["error"]["message"]
    )
    assert_healthy(hostile)


def test_health_answers_while_a_huge_request_is_tokenised(hostile):
    """1,000 prompts of 1,200 characters take seconds to tokenise; the event loop stays free."""
    body = json.dumps({"prompt": ["1+2=3 " * 200] * 1000, "max_tokens": 1}).encode()
    answer: list = []
    big = threading.Thread(target=lambda: answer.append(raw_post(hostile, "/v1/completions", body)))
    big.start()
    during = 0
    while big.is_alive():
        assert httpx.get(f"{hostile}/health", timeout=10).status_code == 200
        during += big.is_alive()
    big.join()
    status, error = answer[0]
    assert status == 400 and error["error"]["param"] == "max_tokens"  # longer than the context
    assert during >= 2, during


def test_scoring_counts_as_pending_and_stops_when_its_client_goes(hostile):
    """700 sequences of 100 tokens take seconds to score: while they run they hold the
    pending budget (generation gets a 429), and a client that leaves frees it mid-way."""
    body = json.dumps({"prompts": [[i % 90 for i in range(100)]] * 700, "starts": [1] * 700})
    gone = _http(hostile).get("disconnected", 0)
    sock = _open(hostile, "/v1/prompt_logprobs", body.encode())
    assert _wait_until(lambda: _http(hostile)["pending"] == 700)
    held = httpx.post(f"{hostile}/v1/completions", json=COMPLETION, timeout=60)
    assert held.status_code == 429 and "700 sequences pending" in held.text
    sock.close()
    assert _wait_until(lambda: _http(hostile)["pending"] == 0)
    assert _http(hostile)["disconnected"] == gone + 1  # stopped, not finished
    assert_healthy(hostile)


def test_scoring_past_the_logit_cap_is_a_400_naming_the_flag(hostile):
    """727 tokens, but one of them 128 long: padded, 600 x 128 x 100 logits."""
    body = {"prompts": [[1] * 128] + [[1]] * 599, "starts": [1] * 600}
    status, answer = raw_post(hostile, "/v1/prompt_logprobs", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == "prompts", answer
    assert "7680000 logit entries" in answer["error"]["message"]
    assert "--max-score-entries" in answer["error"]["message"]
    assert_healthy(hostile)
