"""Bring your own harness against remote servers: sessions opened, read and closed over the
admin routes of real ``rlpost serve`` processes on loopback, and a short training run whose
agent talks to them (rollout.engine=remote)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.rollout.engines.remote_sessions import RemoteSessions
from rlpost.rollout.episodes.agent_runner import AgentRunner, HarnessSettings
from rlpost.rollout.serve.sessions import SessionBounds
from rlpost.types import Prompt
from tests.conftest import ADMIN_HEADERS, TEST_ADMIN_KEY, small_overrides
from tests.integration.test_server import start_server, stop_server

API_KEY = "rlpost-test-api-key"
API_HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def servers(tiny_dir):
    procs, urls = [], []
    try:
        for _ in range(2):
            proc, url = start_server(tiny_dir, "--max-tokens-limit", "64", "--api-key", API_KEY)
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            stop_server(proc)


def _open_ids(url: str) -> list[str]:
    r = httpx.get(f"{url}/v1/sessions", headers=ADMIN_HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["open"]


def agent(prompt: str, base_url: str, api_key: str) -> str:
    """Two completions, the second extending the first (a session's turns); its answer.
    ``RLPOST_TEST_SEEN`` names a file each call appends its base URL to."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = client.completions.create(model="any", prompt=prompt, max_tokens=3, temperature=2.0)
    text = first.choices[0].text
    second = client.completions.create(model="any", prompt=prompt + text + "=", max_tokens=3)
    seen = os.environ.get("RLPOST_TEST_SEEN")
    if seen:
        with open(seen, "a") as f:
            f.write(base_url + "\n")
    return second.choices[0].text


def test_session_routes_need_the_admin_key_and_refuse_bad_bodies(servers):
    url = servers[0]
    body = {"max_requests": 2, "max_tokens": 8, "temperature": 0.0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, API_HEADERS):
        got = httpx.post(f"{url}/v1/sessions", json=body, headers=headers, timeout=30)
        sync = httpx.get(f"{url}/v1/sync/state", headers=headers, timeout=30)
        assert got.status_code == sync.status_code  # the weight routes' auth, exactly
        assert got.status_code == (403 if headers is API_HEADERS else 401), got.text
    for path in ("/v1/sessions/nope", "/v1/sessions"):
        assert httpx.get(f"{url}{path}", headers=API_HEADERS, timeout=30).status_code == 403
    for method in ("get", "delete"):
        r = httpx.request(method, f"{url}/v1/sessions/nope", headers=ADMIN_HEADERS, timeout=30)
        assert r.status_code == 404 and "'nope' is unknown" in r.json()["error"]["message"]
    for bad, needle in (
        (b"{not json", "JSON"),
        (b'{"temperature": "hot"}', "temperature must be a finite number"),
        (b'{"max_tokens": 0}', "max_tokens must be > 0"),
        (b'{"top_p": 2}', "top_p=2"),
        (b'{"stream": true}', "unknown field 'stream'"),
    ):
        r = httpx.post(f"{url}/v1/sessions", content=bad, headers=ADMIN_HEADERS, timeout=30)
        line = r.json()["error"]["message"]
        assert r.status_code == 400 and needle in line and "\n" not in line, line
    assert _open_ids(url) == []  # nothing refused was opened


def test_a_served_session_samples_at_its_own_parameters_and_returns_its_record(servers):
    url = servers[0]
    body = {"max_requests": 2, "max_tokens": 8, "temperature": 0.0}
    opened = httpx.post(f"{url}/v1/sessions", json=body, headers=ADMIN_HEADERS, timeout=30).json()
    sid, own = opened["id"], {"Authorization": f"Bearer {opened['key']}"}
    assert sid in _open_ids(url)
    # The agent asks for temperature 2 and top_p 0.5: the session samples greedily all the same.
    asked = {"prompt": "12+3=", "max_tokens": 4, "temperature": 2.0, "top_p": 0.5}
    for headers in (API_HEADERS, ADMIN_HEADERS):  # only the session's key opens it
        r = httpx.post(f"{url}/sessions/{sid}/v1/completions", json=asked, headers=headers)
        assert r.status_code == 401 and "session key" in r.text
    r = httpx.post(f"{url}/sessions/{sid}/v1/completions", json=asked, headers=own, timeout=60)
    assert r.status_code == 200, r.text
    greedy = {"prompt": "12+3=", "max_tokens": 4, "temperature": 0.0}
    plain = httpx.post(f"{url}/v1/completions", json=greedy, headers=API_HEADERS, timeout=60).json()
    served = r.json()["choices"][0]
    assert served["token_ids"] == plain["choices"][0]["token_ids"]
    record = httpx.get(f"{url}/v1/sessions/{sid}", headers=ADMIN_HEADERS, timeout=30).json()
    (req,) = record["requests"]
    assert req["token_ids"] == served["token_ids"] and req["text"] == served["text"]
    assert len(req["logprobs"]) == len(req["token_versions"]) == len(req["token_ids"])
    assert req["token_versions"] == [0] * len(req["token_ids"]) and req["prompt_ids"]
    closed = httpx.delete(f"{url}/v1/sessions/{sid}", headers=ADMIN_HEADERS, timeout=30).json()
    assert closed["requests"] == record["requests"] and closed["closed"] is True
    assert (
        httpx.get(f"{url}/v1/sessions/{sid}", headers=ADMIN_HEADERS, timeout=30).status_code == 404
    )
    r = httpx.post(f"{url}/sessions/{sid}/v1/completions", json=asked, headers=own, timeout=60)
    assert r.status_code == 404 and sid not in _open_ids(url)


def test_the_runner_opens_sessions_on_the_servers_and_trains_on_their_records(servers, tiny):
    _, tokenizer = tiny
    records: dict[str, dict] = {}
    refused: dict[str, list[int]] = {}

    def fetching(prompt, base_url, api_key, session_id):
        answer = agent(prompt, base_url, api_key)
        server, own = base_url.split("/sessions/")[0], {"Authorization": f"Bearer {api_key}"}
        # The session's key opens that session alone: not the session list, not plain generation
        refused[session_id] = [
            httpx.get(f"{server}/v1/sessions", headers=own, timeout=30).status_code,
            httpx.post(f"{server}/v1/completions", json={"prompt": "1"}, headers=own).status_code,
            httpx.post(f"{base_url}/completions", json={"prompt": "1"}, headers=API_HEADERS,
                       timeout=30).status_code,
        ]  # fmt: skip
        r = httpx.get(f"{server}/v1/sessions/{session_id}", headers=ADMIN_HEADERS, timeout=30)
        records[session_id] = {**r.json(), "server": base_url.split("/sessions/")[0]}
        return answer

    engine = RemoteEngine(servers, tokenizer, api_key=API_KEY, admin_key=TEST_ADMIN_KEY)
    remote = RemoteSessions(servers, TEST_ADMIN_KEY)
    settings = HarnessSettings(fetching, bounds=SessionBounds(4, 8, 30.0), workers=4)
    runner = AgentRunner(engine, tokenizer, settings, remote=remote)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
        prompts = [Prompt("1+2="), Prompt("30+4=")]
        rows = runner.generate(
            [tokenizer(p.text)["input_ids"] for p in prompts], params, n=2, prompts=prompts
        )
    finally:
        runner.close()
        engine.close()
    assert runner.last_stats.sessions == 4 and runner.last_stats.failed == 0
    assert list(refused.values()) == [[401, 401, 401]] * 4
    assert {r["server"] for r in records.values()} == set(servers)  # spread over both
    for session in runner.last_sessions:  # rebuilt from the record the DELETE returned
        got = records[session.id]["requests"]
        assert len(got) == 2 and [r.token_ids for r in session.requests] == [
            r["token_ids"] for r in got
        ]
        assert [r.token_versions for r in session.requests] == [r["token_versions"] for r in got]
    # every trained token and logprob is one the servers recorded, in order, session by session
    recorded = [
        (t, lp) for s in runner.last_sessions for r in records[s.id]["requests"]
        for t, lp in zip(r["token_ids"], r["logprobs"], strict=True)
    ]  # fmt: skip
    trained = [
        (t, lp)
        for c in rows
        for t, lp, m in zip(c.token_ids, c.logprobs, c.loss_mask, strict=True)
        if m
    ]
    assert trained == recorded
    assert all(_open_ids(u) == [] for u in servers)  # every session closed at the end


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_training_steps_with_the_agent_on_remote_servers(
    servers, tiny_dir, tmp_path, monkeypatch, mode
):
    seen = tmp_path / "seen.txt"
    monkeypatch.setenv("RLPOST_API_KEY", API_KEY)  # the servers' key, the trainer's alone
    monkeypatch.setenv("RLPOST_TEST_SEEN", str(seen))
    extra = {"pipeline.mode": "async", "pipeline.max_staleness": 1} if mode == "async" else {}
    over = small_overrides(
        tmp_path,
        **{
            "model.path": str(tiny_dir),
            "rollout.engine": "remote",
            "rollout.engine.servers": json.dumps(servers),
            "rollout.max_tokens": 8,
            "agent.harness.name": "tests.integration.test_agent_harness_remote:agent",
            "agent.harness.workers": 4,
            "train.steps": 2,
            "sft.steps": 3,
            "eval.every": 0,
            "eval.limit": 4,
            "checkpoint.every": 0,
            **extra,
        },
    )
    result = train(load_config(None, over))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "harness_sessions" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["harness_sessions"] == 16.0 and r["harness_dropped_frac"] == 0.0
        assert r["agent_turns_mean"] == 2.0
    if mode == "sync":  # each batch sampled by the newest weights, which the trainer recomputes
        assert [r["policy_version"] for r in steps] == [0, 1]  # the weight push reached them
        assert all(r["logprob_gap"] < 1e-3 for r in steps)  # the logprobs are the records'
    else:
        assert max(r["sample_lag_max"] for r in steps) <= 1
    visits = Path(seen).read_text().split()  # 32 training sessions, then eval's
    assert len(visits) >= 32 and {v.split("/sessions/")[0] for v in visits} == set(servers)
    assert all(_open_ids(u) == [] for u in servers)  # every session closed at the end


def test_a_server_killed_mid_session_drops_the_session_without_a_hang(tiny_dir, tiny):
    """The server dies between a session's two requests: the agent's second request fails,
    the close cannot reach the server; the session is counted failed and dropped, and the
    call returns (no row, no hang)."""
    _, tokenizer = tiny
    proc, url = start_server(tiny_dir, "--max-tokens-limit", "64", "--api-key", API_KEY)

    def dying(prompt, base_url, api_key):
        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
        client.completions.create(model="any", prompt=prompt, max_tokens=3)
        proc.kill()
        proc.wait(timeout=30)
        return client.completions.create(model="any", prompt=prompt, max_tokens=3).choices[0].text

    remote = RemoteSessions([url], TEST_ADMIN_KEY)
    settings = HarnessSettings(dying, bounds=SessionBounds(4, 8, 60.0), workers=1)
    runner = AgentRunner(None, tokenizer, settings, remote=remote)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
        prompt = Prompt("1+2=")
        rows = runner.generate([tokenizer(prompt.text)["input_ids"]], params, n=1, prompts=[prompt])
    finally:
        runner.close()
        stop_server(proc)
    assert rows == []
    assert runner.last_stats.sessions == 1 and runner.last_stats.failed == 1
    assert runner.last_stats.error and "\n" not in runner.last_stats.error
