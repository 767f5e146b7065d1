"""`rlpost serve` as a real process on loopback with the tiny model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rlpost.models.loading import load_causal_lm
from rlpost.rollout.client import CompletionClient, Job, encode_weights
from rlpost.rollout.protocol import SamplingParams

START_TIMEOUT_S = 90


def start_server(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start ``python -m rlpost.rollout.server --port 0`` and return (process, base URL)."""
    cmd = [sys.executable, "-m", "rlpost.rollout.server", "--model", str(model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
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
    proc, url = start_server(tiny_dir, "--max-tokens-limit", "120", "--max-n", "32")
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
    cancelled = httpx.get(f"{server}/health").json()["cancelled"]
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        httpx.post(
            f"{server}/v1/completions",
            json={"prompt": "1", "n": 32, "max_tokens": 110},
            timeout=0.05,  # well under the request's decode time on any machine
        )
    deadline = time.time() + 20
    while time.time() < deadline:
        health = httpx.get(f"{server}/health").json()
        if health["cancelled"] > cancelled and health["active"] == 0:
            break
        time.sleep(0.05)
    assert health["cancelled"] > cancelled and health["active"] == 0
    assert _complete(server, max_tokens=2).status_code == 200


def test_weight_update_changes_outputs_and_version(server, tiny_dir, tmp_path):
    client = CompletionClient(server)
    job = Job("w", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    before = client.complete(job)[0]
    model = load_causal_lm(tiny_dir)
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }
    answer = client.push_weights(encode_weights(noisy.items()), version=5)
    assert answer["policy_version"] == 5 and answer["tensors"] == len(noisy)
    after = client.complete(job)[0]
    assert after.policy_version == 5 and after.token_ids != before.token_ids
    # From a safetensors directory: back to the original weights, version 6.
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    r = httpx.post(f"{server}/v1/weights", json={"path": str(tmp_path), "version": 6}, timeout=60)
    assert r.json()["policy_version"] == 6
    again = client.complete(job)[0]
    assert again.token_ids == before.token_ids and again.policy_version == 6
    bad = httpx.post(
        f"{server}/v1/weights?version=7",
        content=b"junk",
        headers={"content-type": "application/octet-stream"},
    )
    assert bad.status_code == 400 and "not a safetensors file" in bad.json()["error"]["message"]
    assert httpx.get(f"{server}/health").json()["policy_version"] == 6
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
