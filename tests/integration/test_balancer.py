"""Two `rlpost serve` processes behind the load balancer: failover, weights, stale servers."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import httpx
import pytest

from rlpost.config import SyncConfig
from rlpost.models.loading import load_causal_lm, load_tokenizer
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.sync import build_weight_sync
from tests.conftest import ADMIN_HEADERS, TEST_ADMIN_KEY
from tests.integration.test_server import start_server, stop_server


@pytest.fixture(scope="module")
def pair(tiny_dir):
    started: dict[str, tuple] = {}

    def launch(name):
        started[name] = start_server(tiny_dir)

    threads = [threading.Thread(target=launch, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield {"dir": tiny_dir, "servers": started}
    for proc, _ in started.values():
        stop_server(proc)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def _prompts(tok, k):
    return [tok(f"{i}+{i}=", add_special_tokens=False)["input_ids"] for i in range(k)]


def _urls(pair):
    return [pair["servers"][n][1] for n in ("a", "b")]


def test_groups_stay_whole_and_weights_reach_every_server(pair, tok):
    engine = RemoteEngine(_urls(pair), tok, max_inflight_per_server=2, admin_key=TEST_ADMIN_KEY)
    params = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    out = engine.generate(_prompts(tok, 10), params, n=4, group_offset=100)
    assert [c.group for c in out] == [100 + g for g in range(10) for _ in range(4)]
    assert all(c.policy_version == 0 and len(c.token_ids) == len(c.logprobs) for c in out)
    stats = engine.balancer.stats()["servers"]
    assert sum(s["completed"] for s in stats.values()) == 10
    assert all(s["completed"] > 0 for s in stats.values())  # both servers took prompts
    model = load_causal_lm(pair["dir"])
    engine.load_weights(model.named_parameters(), version=1)
    assert [httpx.get(f"{u}/health").json()["policy_version"] for u in _urls(pair)] == [1, 1]
    assert {c.policy_version for c in engine.generate(_prompts(tok, 4), params, n=2)} == {1}
    engine.close()


def test_server_behind_on_weights_leaves_rotation(pair, tok):
    """A server that missed an update (e.g. restarted) must not serve a synchronous step."""
    model = load_causal_lm(pair["dir"])
    engine = RemoteEngine(
        _urls(pair), tok, version=1, max_inflight_per_server=2, admin_key=TEST_ADMIN_KEY
    )
    behind = pair["servers"]["b"][1]
    http = build_weight_sync(SyncConfig(channel="http"), [behind], headers=ADMIN_HEADERS)
    http.push(model.named_parameters(), 0)
    http.close()
    params = SamplingParams(temperature=1.0, max_tokens=4)
    out = engine.generate(_prompts(tok, 8), params, n=2)
    assert {c.policy_version for c in out} == {1} and len(out) == 16
    assert engine.stale_answers >= 1 and not engine.balancer.stats()["servers"][behind]["up"]
    engine.load_weights(model.named_parameters(), version=2)
    assert httpx.get(f"{behind}/health").json()["policy_version"] == 2
    assert engine.balancer.stats()["servers"][behind]["up"]  # the push brought it back
    engine.close()


def test_killed_server_mid_rollout_every_prompt_answered_once(pair, tok):
    engine = RemoteEngine(_urls(pair), tok, version=2, max_inflight_per_server=3, cooldown_s=60)
    victim_proc, victim_url = pair["servers"]["a"]
    done_before = httpx.get(f"{victim_url}/health").json()["requests"]

    def kill_after_first_answer():
        while httpx.get(f"{victim_url}/health").json()["requests"] == done_before:
            time.sleep(0.01)
        victim_proc.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_answer, daemon=True)
    killer.start()
    params = SamplingParams(temperature=1.0, max_tokens=60, stop_token_ids=(tok.eos_token_id,))
    out = engine.generate(_prompts(tok, 24), params, n=4)
    killer.join(5)
    assert victim_proc.wait(5) == -signal.SIGKILL
    assert Counter(c.group for c in out) == {g: 4 for g in range(24)}
    stats = engine.balancer.stats()
    assert stats["retries"] >= 1 and stats["servers"][victim_url]["failures"] >= 1
    assert sum(s["completed"] for s in stats["servers"].values()) == 24
    engine.close()
