"""`rlpost serve` as a real process on loopback with the tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from rlpost.config import SyncConfig
from rlpost.models.loading import load_causal_lm
from rlpost.rollout.engines.client import CompletionClient, Job
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.sync import build_weight_sync
from tests.conftest import ADMIN_HEADERS

START_TIMEOUT_S = 90


def start_server(
    model_dir, *extra: str, env: dict | None = None, entry: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m rlpost.rollout.serve.server --port 0`` and return (process, base URL).

    ``env`` is added to the environment; ``entry`` replaces ``-m rlpost.rollout.serve.server``.
    """
    entry = entry or ["-m", "rlpost.rollout.serve.server"]
    cmd = [sys.executable, *entry, "--model", str(model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not lines or "listening on" not in lines[0]:
        proc.kill()
        raise RuntimeError(f"server did not start: {lines}")
    url = lines[0].split("listening on ")[1].split()[0]
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server never became healthy")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_dir):
    limits = ("--max-tokens-limit", "120", "--max-n", "32")
    proc, url = start_server(tiny_dir, *limits)
    yield url
    stop_server(proc)


def _complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"prompt": "1+2=", **body}, timeout=60)


def test_completion_returns_ids_logprobs_and_version(server):
    r = _complete(server, n=3, max_tokens=6, logprobs=0, temperature=0.9, seed=1)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["policy_version"] == 0
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        assert len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) <= 6
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
        assert c["finish_reason"] in ("stop", "length") and c["policy_versions"] == [0]
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True},
        timeout=60,
    ).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert set(entry) >= {"token", "logprob", "bytes", "top_logprobs"}
    assert chat["choices"][0]["message"]["role"] == "assistant"


def test_concurrent_requests_share_decode_steps(server):
    before = httpx.get(f"{server}/health").json()["steps"]
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(_complete(server, n=2, max_tokens=30)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 4
    health = httpx.get(f"{server}/health").json()
    assert health["max_batch_seen"] > 2  # more than one request's rows in a step
    assert health["steps"] - before < 4 * 30


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"prompt": "1", "model": "gpt-9"}, 404, "does not exist"),
        ({"prompt": "1", "max_tokens": 121}, 400, "max_tokens=121 must be in [1, 120]"),
        ({"prompt": "1", "n": 33}, 400, "n=33 must be in [1, 32]"),
        ({"prompt": ""}, 400, "prompt is empty"),
        ({"prompt": [], "max_tokens": 2}, 400, "prompt is missing or empty"),
        ({"prompt": "1", "temperature": "hot"}, 400, "temperature must be a number"),
        ({"prompt": "x" * 100, "max_tokens": 100}, 400, "exceeds the model's context"),
        (b'{"prompt": "1", "temperature": NaN}', 400, "temperature must be a finite number"),
        (b'{"prompt": "1", "top_p": Infinity}', 400, "top_p must be a finite number"),
        ({"prompt": [[5]] * 1025, "max_tokens": 1}, 400, "takes at most 1024"),
    ],
)
def test_bad_input_is_a_one_line_4xx(server, body, status, says):
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server}/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]
    assert "\n" not in error["message"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_client_disconnect_frees_its_slots(server):
    # A raw connection sends a long request and goes away once the server is generating it:
    # no client timeout to tune, whatever the machine's speed.
    cancelled = httpx.get(f"{server}/health").json()["cancelled"]
    host, port = server.removeprefix("http://").split(":")
    # 8 prompts x 32 samples x 110 tokens: long enough that the server sees the close
    # (it polls every POLL_SECONDS) well before it finishes, on any machine
    request = {"prompt": ["1"] * 8, "n": 32, "max_tokens": 110, "ignore_eos": True}
    body = json.dumps(request).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(head + body)
    deadline = time.time() + 20
    while httpx.get(f"{server}/health").json()["active"] == 0 and time.time() < deadline:
        time.sleep(0.005)
    conn.close()
    while time.time() < deadline:
        health = httpx.get(f"{server}/health").json()
        if health["cancelled"] > cancelled and health["active"] == 0:
            break
        time.sleep(0.05)
    assert health["cancelled"] > cancelled and health["active"] == 0
    assert _complete(server, max_tokens=2).status_code == 200


def test_weight_update_changes_outputs_and_version(server, tiny_dir):
    """Weights reach the server through the http sync channel, the one door for weights."""
    client = CompletionClient(server)
    job = Job("w", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    before = client.complete(job)[0]
    model = load_causal_lm(tiny_dir)
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }
    sync = build_weight_sync(SyncConfig(channel="http"), [server], headers=ADMIN_HEADERS)
    assert sync.push(noisy.items(), 5).committed == [server]
    after = client.complete(job)[0]
    assert after.policy_version == 5 and after.token_ids != before.token_ids
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync.push(original.items(), 6)
    again = client.complete(job)[0]
    assert again.token_ids == before.token_ids and again.policy_version == 6
    assert httpx.get(f"{server}/health").json()["policy_version"] == 6
    assert httpx.post(f"{server}/v1/weights", headers=ADMIN_HEADERS).status_code == 404
    sync.close()
    client.close()


def test_metrics_export_rollout_throughput(server):
    _complete(server, max_tokens=4)
    text = httpx.get(f"{server}/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("rl_rollout")
    }
    assert "rl_rollout_throughput_tps" in values and "rl_rollout_worker_utilization" in values
    assert values["rl_rollout_throughput_tps"] > 0
    assert 0 <= values["rl_rollout_worker_utilization"] <= 1


def _stream(url, path, body):
    """The parsed ``data:`` events of a streamed request, up to and without ``[DONE]``."""
    events, done = [], False
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    done = True
                    continue
                events.append(json.loads(line[len("data: ") :]))
    assert done
    return events


def test_stream_matches_the_whole_response(server):
    body = {"prompt": "1+2=", "n": 2, "max_tokens": 12, "seed": 3, "logprobs": 0}
    whole = _complete(server, **body).json()
    events = _stream(server, "/v1/completions", body)
    for c in whole["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == c["index"]]
        assert [t for m in mine for t in m["token_ids"]] == c["token_ids"]
        streamed_lp = [lp for m in mine for lp in m["logprobs"]["token_logprobs"]]
        assert streamed_lp == pytest.approx(c["logprobs"]["token_logprobs"])
        assert "".join(m["text"] for m in mine) == c["text"]
        assert mine[-1]["finish_reason"] == c["finish_reason"]
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert all(m["policy_version"] == c["policy_version"] for m in mine)


def test_stream_never_sends_a_stop_text(server):
    body = {"prompt": "1+2=", "max_tokens": 40, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    text = _complete(server, **body).json()["choices"][0]["text"]
    stop = text[3:6]  # a stop text that occurs in the sample
    assert len(stop) == 3
    whole = _complete(server, **body, stop=[stop]).json()["choices"][0]
    events = _stream(server, "/v1/completions", {**body, "stop": [stop]})
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == whole["text"] and stop not in streamed
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_with_usage(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    events = _stream(server, "/v1/chat/completions", body)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(events) - 1
    )
    assert all(len(e["choices"][0]["logprobs"]["content"]) == 1 for e in events[:-1])


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"min_p": 0.1}, "min_p"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_unimplemented_parameters_are_refused_by_name(server, path, extra, param):
    base = (
        {"prompt": "1"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    r = httpx.post(f"{server}{path}", json={**base, "max_tokens": 2, **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_tools_on_a_model_without_a_chat_template_are_a_400_naming_it(server):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [tool]}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools" and "'model' has no chat template" in error["message"]


def test_neutral_values_of_unimplemented_parameters_pass(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u"}
    assert httpx.post(f"{server}/v1/chat/completions", json={**chat, **neutral}).status_code == 200
    r = _complete(server, max_tokens=2, n=2, best_of=2, echo=False, suffix=None)
    assert r.status_code == 200


def test_logit_bias_and_penalties_change_sampling(server):
    greedy = {"prompt": "1+2=", "max_tokens": 8, "temperature": 0}
    plain = _complete(server, **greedy).json()["choices"][0]["token_ids"]
    forced = _complete(server, **greedy, logit_bias={"7": 100}).json()["choices"][0]["token_ids"]
    assert forced == [7] * 8 != plain
    penalised = _complete(server, **greedy, logit_bias={"7": 5}, frequency_penalty=2.0).json()
    ids = penalised["choices"][0]["token_ids"]
    assert ids[0] == 7 and ids.count(7) < 8  # the penalty grows with each repeat
    assert _complete(server, **greedy).json()["choices"][0]["token_ids"] == plain


def test_stream_disconnect_frees_its_slots(server):
    cancelled = httpx.get(f"{server}/health").json()["cancelled"]
    body = {"prompt": "1", "n": 32, "max_tokens": 110, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # one event, then the client hangs up
    deadline = time.time() + 20
    while time.time() < deadline:
        health = httpx.get(f"{server}/health").json()
        if health["cancelled"] > cancelled and health["active"] == 0:
            break
        time.sleep(0.05)
    assert health["cancelled"] > cancelled and health["active"] == 0
