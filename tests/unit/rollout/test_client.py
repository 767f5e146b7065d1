"""Client wire format and the load balancer, against in-process fake servers."""

import threading
import time

import pytest

from rlpost.rollout.engines.client import (
    Choice,
    Job,
    RequestLoadBalancer,
    RequestRejected,
    ServerUnavailable,
    completion_body,
    parse_choices,
)
from rlpost.rollout.engines.protocol import SamplingParams

PARAMS = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, stop_token_ids=(2,))


def test_completion_body_carries_sampling_and_vllm_fields():
    body = completion_body(Job("j", [5, 6], PARAMS, n=4, seed=9), model="m")
    assert body["prompt"] == [5, 6] and body["n"] == 4 and body["seed"] == 9
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (
        0.5,
        0.9,
        5,
        7,
    )
    assert body["stop_token_ids"] == [2] and body["logprobs"] == 0 and body["model"] == "m"
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]


def test_parse_rlpost_response_in_index_order():
    response = {
        "policy_version": 3,
        "choices": [
            {"index": 1, "text": "b", "token_ids": [8], "finish_reason": "length",
             "logprobs": {"token_logprobs": [-0.5]}, "policy_version": 2, "policy_versions": [2, 3]},
            {"index": 0, "text": "a", "token_ids": [7, 2], "finish_reason": "stop",
             "logprobs": {"token_logprobs": [-1.0, -2.0]}},
        ],
    }  # fmt: skip
    a, b = parse_choices(response)
    assert (a.token_ids, a.logprobs, a.finish_reason, a.policy_version) == (
        [7, 2],
        [-1.0, -2.0],
        "stop",
        3,
    )
    assert (b.policy_version, b.versions) == (2, [2, 3])


def test_vllm_token_id_strings_and_retokenize_fallback():
    vllm_style = {"choices": [{"index": 0, "text": "xy", "finish_reason": "stop",
                  "logprobs": {"tokens": ["token_id:4", "token_id:2"], "token_logprobs": [-1, -2]}}]}  # fmt: skip
    assert parse_choices(vllm_style)[0].token_ids == [4, 2]
    plain = {"choices": [{"index": 0, "text": "ab", "finish_reason": "stop",
             "logprobs": {"tokens": ["a", "b", ""], "token_logprobs": [-1, -1, -3]}}]}  # fmt: skip
    choice = parse_choices(plain, tokenize=lambda t: [ord(c) for c in t], eos_id=0)[0]
    assert choice.token_ids == [97, 98, 0]  # the stop token has no text: appended
    bad = {"choices": [{"index": 0, "text": "abc", "finish_reason": "length",
           "logprobs": {"token_logprobs": [-1]}}]}  # fmt: skip
    with pytest.raises(ValueError, match="3 token ids but 1 logprobs"):
        parse_choices(bad, tokenize=lambda t: list(t.encode()))
    with pytest.raises(ValueError, match="no tokenizer"):
        parse_choices({"choices": [{"index": 0, "text": "a", "logprobs": {}}]})


class FakeClient:
    """A server that answers each job with one token per sample, after ``delay`` seconds."""

    def __init__(self, url, delay=0.02, fail_after=None, reject=False):
        self.url, self.delay, self.fail_after, self.reject = url, delay, fail_after, reject
        self.served, self.inflight, self.peak = [], 0, 0
        self.lock = threading.Lock()

    def complete(self, job, tokenize=None, eos_id=None):
        with self.lock:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        try:
            time.sleep(self.delay)
            if self.reject:
                raise RequestRejected(f"{self.url}: HTTP 400: bad")
            if self.fail_after is not None and len(self.served) >= self.fail_after:
                raise ServerUnavailable(f"{self.url}: connection refused")
            self.served.append(job.id)
            return [Choice([1], [-0.1], "stop", "x", 0) for _ in range(job.n)]
        finally:
            with self.lock:
                self.inflight -= 1

    def close(self):
        """Nothing to release."""


def _jobs(k, n=4):
    return [Job(f"j{i}", [1, 2], PARAMS, n) for i in range(k)]


def test_jobs_spread_by_outstanding_and_answered_once():
    a, b = FakeClient("a"), FakeClient("b", delay=0.06)
    lb = RequestLoadBalancer([a, b], max_inflight=2)
    results = lb.run(_jobs(20))
    assert sorted(results) == sorted(j.id for j in _jobs(20))
    assert all(len(c) == 4 for c in results.values())
    assert len(a.served) + len(b.served) == 20 and len(a.served) > len(
        b.served
    )  # faster server, more jobs
    assert a.peak <= 2 and b.peak <= 2


def test_failed_server_jobs_are_resent_exactly_once():
    dying, healthy = FakeClient("dying", fail_after=2), FakeClient("ok")
    lb = RequestLoadBalancer([dying, healthy], max_inflight=3, cooldown_s=60)
    seen = []
    results = lb.run(_jobs(12), on_result=lambda job_id, url: seen.append(job_id))
    assert sorted(results) == sorted(seen) == sorted(j.id for j in _jobs(12))
    assert len(seen) == len(set(seen)) == 12
    assert set(dying.served).isdisjoint(healthy.served)
    assert lb.retries >= 1 and lb.stats()["servers"]["dying"]["up"] is False


def test_rejection_is_raised_and_all_down_is_loud():
    lb = RequestLoadBalancer([FakeClient("x", reject=True)])
    with pytest.raises(RequestRejected, match="HTTP 400"):
        lb.run(_jobs(3))
    lb = RequestLoadBalancer([FakeClient("d", fail_after=0)], cooldown_s=0.01, max_attempts=3)
    with pytest.raises(RuntimeError, match="failed on 3 attempts"):
        lb.run(_jobs(1))
    lb = RequestLoadBalancer([FakeClient("e")])
    lb.disable("e")
    with pytest.raises(RuntimeError, match="out of rotation"):
        lb.run(_jobs(1))
    with pytest.raises(ValueError, match="unique"):
        RequestLoadBalancer([FakeClient("f")]).run(_jobs(1) + _jobs(1))


def test_a_busy_server_is_retried_after_what_it_asks_not_refused():
    """429 (too many pending) and 408 are the server's load, not the request's fault: the
    balancer sends the job elsewhere or later, after the server's Retry-After."""
    import http.server
    import json

    from rlpost.rollout.engines.client import CompletionClient

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"error": {"message": "too many pending requests"}}).encode()
            self.send_response(int(self.path.rsplit("/", 1)[-1]))
            self.send_header("retry-after", "2")
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            """Quiet."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = CompletionClient(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        for status in (429, 408):
            with pytest.raises(ServerUnavailable, match=f"HTTP {status}") as err:
                client._post(f"/busy/{status}", json={})
            assert err.value.retry_after == 2.0
        with pytest.raises(RequestRejected, match="HTTP 400"):
            client._post("/busy/400", json={})
    finally:
        client.close()
        server.shutdown()
