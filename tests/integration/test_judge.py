"""JudgeScorer against a real HTTP server on 127.0.0.1 that misbehaves on demand.

The server reads a marker from the judged completion and answers with a score,
garbage, an error, a slow reply, or an error followed by a score, on both
OpenAI-compatible routes.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from rlpost.rewards.judge import JudgeScorer
from rlpost.types import RewardSample


class JudgeHandler(BaseHTTPRequestHandler):
    seen: ClassVar[dict[str, int]] = {}
    lock = threading.Lock()

    def log_message(self, *args):  # keep pytest output clean
        return

    def _reply(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self._reply(404, "{}")
        text = request["messages"][0]["content"] if chat else request["prompt"]
        marker = text.split("CASE:")[1].split()[0]
        with self.lock:
            self.seen[marker] = self.seen.get(marker, 0) + 1
            attempt = self.seen[marker]
        if marker == "error":
            return self._reply(500, '{"error": "boom"}')
        if marker == "badrequest":
            return self._reply(400, '{"error": "bad model"}')
        if marker == "notjson":
            return self._reply(200, "<html>")
        if marker == "slow":
            time.sleep(1.0)
        if marker == "flaky" and attempt == 1:
            return self._reply(503, "{}")
        reply = {
            "score7": "The answer is right but terse. Score: 7",
            "slow": "Score: 10",
            "flaky": "Score: 4",
            "garbage": "I refuse to grade this.",
            "toohigh": "Score: 42",
            "number": "8",
        }[marker]
        choice = {"message": {"role": "assistant", "content": reply}} if chat else {"text": reply}
        return self._reply(200, json.dumps({"choices": [choice]}))


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def judged(*markers: str) -> list[RewardSample]:
    return [RewardSample("What is 2+2?", f"4 CASE:{m} ", answer=4) for m in markers]


def make(base_url, **kwargs) -> JudgeScorer:
    settings = {"timeout": 0.4, "retries": 2, "backoff": 0.01, "default_score": -1.0}
    return JudgeScorer(base_url, "judge-model", **(settings | kwargs))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_scores_are_parsed_and_normalised(base_url, api):
    judge = make(base_url, api=api)
    try:
        assert judge.score(judged("score7", "number")) == [0.7, 0.8]
    finally:
        judge.close()
    assert judge.counters() == {"requests": 2}


def test_failures_fall_back_to_default_and_are_counted(base_url):
    JudgeHandler.seen.clear()
    judge = make(base_url, concurrency=4)
    markers = ("garbage", "toohigh", "error", "badrequest", "notjson", "slow", "flaky", "score7")
    start = time.monotonic()
    try:
        scores = judge.score(judged(*markers))
    finally:
        judge.close()
    elapsed = time.monotonic() - start
    assert scores == [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.4, 0.7]
    counts = judge.counters()
    assert counts["failures"] == 6
    assert counts["failures_unparsable"] == 2  # garbage, and 42 is above max_score
    assert counts["failures_http"] == 2  # 500 after retries; 400 at once
    assert counts["failures_bad_response"] == 1
    assert counts["failures_timeout"] == 1
    # error: 2 retries, slow: 2 retries, flaky: 1 retry; 400 and garbage are not retried
    assert counts["retries"] == 5
    assert JudgeHandler.seen["error"] == 3 and JudgeHandler.seen["badrequest"] == 1
    assert elapsed < 2.5  # 3 timeouts of 0.4 s run concurrently with the rest


def test_concurrency_overlaps_slow_requests(base_url):
    judge = make(base_url, concurrency=4, timeout=5.0, retries=0)
    start = time.monotonic()
    try:
        assert judge.score(judged("slow", "slow", "slow", "slow")) == [1.0] * 4
    finally:
        judge.close()
    assert time.monotonic() - start < 2.5  # four 1 s replies, not 4 s in sequence


def test_wrong_route_is_not_retried(base_url):
    judge = make(base_url.removesuffix("/v1") + "/v2")
    try:
        assert judge.score(judged("score7")) == [-1.0]
    finally:
        judge.close()
    assert judge.counters()["failures_http"] == 1 and "retries" not in judge.counters()
