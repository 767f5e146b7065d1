"""A session's JSON record (what ``DELETE /v1/sessions/{id}`` returns) and the body that opens
one: the record reads back into the same rows, a bad record or body is refused in one line."""

from __future__ import annotations

import json

import pytest

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.serve.openai_params import APIError
from rlpost.rollout.serve.sessions import (
    Request,
    Session,
    SessionBounds,
    parse_open,
    session_from_record,
    session_record,
    session_samples,
)


def _session() -> Session:
    s = Session("abc", SessionBounds(4, 16, 10.0), SamplingParams(temperature=0.7))
    s.requests = [
        Request([1, 2], [3, 4], [-0.5, -0.25], [0, 1], "stop", text="x", tool_calls=1),
        Request([1, 2, 3, 4, 9], [5], [-1.5], [1], "length", text="y"),
    ]
    s.bound_hit = "tokens"
    return s


def test_a_record_reads_back_into_the_same_rows_through_json():
    s = _session()
    record = json.loads(json.dumps(session_record(s)))
    assert record["requests"][0]["token_versions"] == [0, 1] and record["bound_hit"] == "tokens"
    back = session_from_record(record, s.bounds, s.sampling)
    assert back.requests == s.requests and back.bound_hit == "tokens" and back.closed
    mine, theirs = session_samples(s, 3), session_samples(back, 3)
    assert [(c.token_ids, c.logprobs, c.loss_mask, c.token_versions) for c in mine] == [
        (c.token_ids, c.logprobs, c.loss_mask, c.token_versions) for c in theirs
    ]
    assert mine[0].token_ids == [3, 4, 9, 5] and mine[0].loss_mask == [1, 1, 0, 1]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda r: r["requests"][0].pop("logprobs"), "bad request entry (KeyError"),
        (lambda r: r["requests"][1].update(token_versions=[]), "differ in length"),
        (lambda r: r["requests"][0].update(token_ids="ab"), "bad request entry (ValueError"),
    ],
)
def test_a_bad_record_is_one_line_naming_it(edit, needle):
    s = _session()
    record = session_record(s)
    edit(record)
    with pytest.raises(ValueError, match="session record") as err:
        session_from_record(record, s.bounds, s.sampling)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_opening_body_sets_bounds_and_sampling():
    bounds, sampling, seed = parse_open(
        b'{"max_requests": 2, "max_tokens": 9, "max_seconds": 3, "temperature": 0.5,'
        b' "top_p": 0.9, "top_k": 5, "seed": 7}'
    )
    assert bounds == SessionBounds(2, 9, 3.0) and seed == 7
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 5)
    assert parse_open(b"{}") == (SessionBounds(), SamplingParams(), None)


@pytest.mark.parametrize(
    "body, needle",
    [
        (b'{"max_requests": 2.5}', "max_requests must be an integer, got 2.5"),
        (b'{"max_requests": true}', "max_requests must be an integer"),
        (b'{"max_seconds": 1e999}', "max_seconds must be a finite number"),
        (b'{"max_seconds": -1}', "max_seconds must be > 0"),
        (b'{"temperature": -1}', "temperature=-1"),
        (b'{"top_k": 0}', "top_k=0"),
        (b'{"seed": -3}', "seed must be in [0, 2**62)"),
        (b'{"n": 2}', "unknown field 'n'"),
        (b"[1]", "JSON object"),
    ],
)
def test_a_bad_opening_body_is_a_400_in_one_line(body, needle):
    with pytest.raises(APIError) as err:
        parse_open(body)
    assert err.value.status == 400 and needle in err.value.message, err.value.message
    assert "\n" not in err.value.message
