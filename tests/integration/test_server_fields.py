"""Every documented field of every JSON route, sent with the wrong type: a 4xx naming the
field, never a 500. One real server on loopback, raw HTTP."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_server import start_server, stop_server
from tests.integration.test_server_hostile import assert_healthy, raw_post

ADMIN = "fields-admin-key"
INT = ["1", 1.5, [], {}, True]
NUMBER = ["1", [], {}, True]
BOOL = ["true", 1, [], {}]
TEXT = [5, [], {}]
LIST = [5, "x", {}]
OBJECT = [5, "x", []]

COMPLETION = {"prompt": "1+", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
COMMON = {
    "model": TEXT, "n": INT, "temperature": NUMBER, "top_p": NUMBER, "top_k": INT,
    "max_tokens": INT, "stop": [5, {}, [5], True], "stop_token_ids": [*LIST, ["a"]],
    "seed": INT, "ignore_eos": BOOL, "stream": BOOL, "stream_options": OBJECT,
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "logit_bias": [*OBJECT, {"1": "x"}], "user": TEXT, "return_token_ids": BOOL,
    "return_tokens_as_token_ids": BOOL,
}  # fmt: skip
ROUTES = {
    "/v1/completions": (
        COMPLETION,
        {
            **COMMON, "prompt": [5, {}, True, 1.5, [[]], ["a", 5]], "logprobs": INT,
            "add_special_tokens": BOOL, "echo": TEXT, "suffix": TEXT, "best_of": INT,
        },
    ),
    "/v1/chat/completions": (
        CHAT,
        {
            **COMMON, "logprobs": BOOL, "max_completion_tokens": INT, "top_logprobs": INT,
            "tools": [*LIST, [5], [{"type": "function", "function": 5}]],
            "tool_choice": [5, [], {"type": 5}], "parallel_tool_calls": BOOL,
            "functions": [5, "x"], "function_call": [5, []], "response_format": [5, "x"],
            "messages": [
                *LIST, [5], [{"role": 5}], [{"role": "user", "content": 5}],
                [{"role": "assistant", "content": "", "tool_calls": 5}],
                [{"role": "assistant", "tool_calls": [5]}],
                [{"role": "tool", "content": "x", "tool_call_id": 5}],
                [{"role": "user", "content": "x", "name": 5}],
            ],
        },
    ),
    "/v1/prompt_logprobs": (
        {"prompts": [[1, 2, 3]], "starts": [1]},
        {"prompts": [*LIST, [5], [["a"]], [[1.5]]], "starts": [*LIST, ["a"], [1.5], [True]]},
    ),
    "/v1/sync/start": (
        {"session": "s1", "version": 1, "codec": "raw", "bucket_bytes": 1024},
        {
            "session": TEXT, "version": INT, "codec": TEXT, "bucket_bytes": INT, "delta": BOOL,
            "base_version": INT, "run_id": TEXT,
        },
    ),
    "/v1/sync/s1/finish": (
        {"session": "s1", "buckets": 0, "tensors": []},
        {
            "session": TEXT, "buckets": INT,
            "tensors": [*LIST, [5], [{"name": 5}], [{"name": "w", "codec": "raw", "parts": 5,
                                                     "meta": {}, "checksum": 0}]],
        },
    ),
}  # fmt: skip
CASES = [
    pytest.param(path, field, value, id=f"{path}:{field}={json.dumps(value)}")
    for path, (_, fields) in ROUTES.items()
    for field, values in fields.items()
    for value in values
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = start_server(tiny_dir, env={"RLPOST_ADMIN_KEY": ADMIN})
    yield url
    assert_healthy(url)
    stop_server(proc)


@pytest.mark.parametrize(("path", "field", "value"), CASES)
def test_a_wrong_typed_field_is_a_4xx_naming_it(server, path, field, value):
    base, _ = ROUTES[path]
    body = json.dumps({**base, field: value}).encode()
    status, answer = raw_post(server, path, body, headers={"authorization": f"Bearer {ADMIN}"})
    error = answer.get("error", {})
    message = error.get("message", "")
    assert 400 <= status < 500, (status, answer)
    assert field in (error.get("param") or "") or field in message, answer
    assert "\n" not in message
