"""Session records -> training rows: interleaving where prompts extend, segments where not."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.serve.openai_params import APIError
from rlpost.rollout.serve.sessions import (
    Request,
    Session,
    SessionBounds,
    SessionStore,
    admit,
    session_samples,
    unbounded_body,
)


def _session(*requests: Request) -> Session:
    return Session("s", SessionBounds(), SamplingParams(), requests=list(requests))


def test_extending_requests_interleave_with_the_added_tokens_masked():
    a = Request([1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", text="x", tool_calls=1)
    b = Request([1, 2, 3, 4, 9, 9], [5], [-0.5], [1], "stop", text="y")
    (row,) = session_samples(_session(a, b), group=3)
    assert row.prompt_ids == [1, 2] and row.token_ids == [3, 4, 9, 9, 5]
    assert row.loss_mask == [1, 1, 0, 0, 1] and row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5]
    assert row.token_versions == [0, 0, 0, 0, 1]  # added tokens: the version before them
    assert row.group == 3 and row.episode.answer == "y" and row.episode.tool_calls == 1
    assert [t.role for t in row.episode.turns] == ["policy", "env", "policy"]


def test_a_rewritten_history_starts_a_segment_on_the_context_the_model_saw():
    a = Request([1, 2], [7, 8, 3], [-1.0, -1.0, -1.0], [0, 0, 0], "stop")
    b = Request([1, 2, 3, 9], [5, 6], [-0.5, -0.6], [0, 0], "length")  # 7, 8 stripped
    c = Request([1, 2, 3, 9, 5, 6, 4], [2], [-0.3], [0], "stop")
    first, second = session_samples(_session(a, b, c), group=0, answer="42")
    assert first.prompt_ids == [1, 2] and first.token_ids == [7, 8, 3]
    assert second.prompt_ids == [1, 2, 3, 9] and second.token_ids == [5, 6, 4, 2]
    assert second.loss_mask == [1, 1, 0, 1]
    assert first.episode.answer == second.episode.answer == "42"
    assert first.finish_reason == "stop" and second.finish_reason == "stop"


def test_an_empty_session_gives_no_rows():
    assert session_samples(_session(), group=0) == []


def test_the_planned_body_drops_the_model_and_remembers_max_tokens():
    raw, asked = unbounded_body(json.dumps({"model": "gpt", "max_completion_tokens": 7}).encode())
    assert json.loads(raw) == {"max_tokens": 1} and asked == 7


def test_a_bad_max_tokens_is_a_400_naming_the_field():
    for body, name in (
        ({"max_tokens": "x"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ):
        with pytest.raises(APIError) as caught:
            unbounded_body(json.dumps(body).encode())
        assert caught.value.status == 400 and caught.value.param == name
        assert caught.value.message.startswith(f"{name} must be an integer >= 1, got ")


def _plan(max_tokens: int = 100):
    params = replace(SamplingParams(), max_tokens=max_tokens)
    return SimpleNamespace(stream=False, prompts=[[1, 2]], fields={"n": 1, "params": params})


def test_admitted_requests_reserve_their_share_of_the_bounds():
    """Admission counts what requests still generating may use, so concurrent requests
    cannot together pass a bound that each alone respects."""
    session = _session()
    session.bounds = SessionBounds(max_requests=3, max_tokens=10, max_seconds=60)
    first = admit(session, _plan(6), context=1000)
    second = admit(session, _plan(6), context=1000)
    assert (first, second) == (6, 4)  # the second gets what the first left
    with pytest.raises(APIError, match="sampled tokens are spent"):
        admit(session, _plan(6), context=1000)
    session.settle(first, Request([1, 2], [3, 4], [0.0, 0.0], [0, 0], "stop"))
    third = admit(session, _plan(6), context=1000)  # the first used 2 of its 6
    assert third == 4
    with pytest.raises(APIError, match="all 3 requests are spent"):
        admit(session, _plan(1), context=1000)
    session.settle(second)  # refused or failed: nothing recorded, the share returned
    session.settle(third)
    assert len(session.requests) == 1 and admit(session, _plan(100), context=1000) == 8


def test_expired_sessions_are_reaped_and_open_sessions_capped():
    store = SessionStore(max_open=2, reap_after_s=0.0)
    short = SessionBounds(max_seconds=1e-9)
    old = store.open(short, SamplingParams())
    kept = store.open(SessionBounds(), SamplingParams())
    store.open(SessionBounds(), SamplingParams())  # the expired one makes room
    assert old.closed and old.id not in store.ids() and kept.id in store.ids()
    with pytest.raises(APIError) as caught:
        store.open(SessionBounds(), SamplingParams())
    assert caught.value.status == 429 and "2 sessions are open" in caught.value.message
    assert "\n" not in caught.value.message and store.reaped == 1
