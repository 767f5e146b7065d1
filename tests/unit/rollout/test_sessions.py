"""Session records -> training rows: interleaving where prompts extend, segments where not."""

from __future__ import annotations

import json

from rlpost.rollout.protocol import SamplingParams
from rlpost.rollout.sessions import Request, Session, SessionBounds, session_samples, unbounded_body


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
