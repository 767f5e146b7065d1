"""The official ``openai`` client against a real `rlpost serve`: streams, keys, refusals."""

from __future__ import annotations

import pytest

from tests.integration.test_server import start_server, stop_server

openai = pytest.importorskip("openai")  # in the test extra; skipped only outside it

KEY = "client-test-key"


@pytest.fixture(scope="module")
def client(tiny_dir):
    proc, url = start_server(tiny_dir, env={"RLPOST_API_KEY": KEY, "RLPOST_ADMIN_KEY": "admin-x"})
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()
    stop_server(proc)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_streams_completions_like_the_whole_response(client):
    args = {"model": _model(client), "prompt": "1+2=", "max_tokens": 10, "seed": 4, "logprobs": 0}
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    streamed_ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert streamed_ids == whole.model_extra["token_ids"]
    logprobs = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs)
    assert {c.choices[0].model_extra["policy_version"] for c in chunks} == {0}


def test_streams_chat_with_logprobs_and_usage(client):
    stream = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    tokens = [c for c in chunks if c.choices]
    assert tokens[0].choices[0].delta.role == "assistant"
    assert 1 <= len(tokens) <= 6 and tokens[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in tokens[:-1])
    assert all(len(c.choices[0].logprobs.content[0].top_logprobs) == 2 for c in tokens)
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_refusals_reach_the_client_as_errors(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=_model(client),
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        )
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="m", prompt="1", max_tokens=1)
    wrong.close()
