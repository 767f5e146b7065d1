"""Tools on a chat request: checks, rendering with the chat template, calls read back."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from rlpost.models.tiny import build_char_tokenizer
from rlpost.rollout.serve.openai_params import APIError
from rlpost.rollout.serve.tool_calls import (
    ToolStream,
    chat_prompt,
    chat_turns,
    parse_tools,
    read_calls,
    schema_problem,
)
from rlpost.rollout.serve.tool_parsers import tool_format

HERMES = tool_format("hermes")
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]


def _refused(body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_tools(body, HERMES)
    assert caught.value.status == 400
    return caught.value


def _tokenizer(template: str | None):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def test_tools_and_choices_are_read():
    assert parse_tools({}, HERMES) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}, HERMES) is None
    req = parse_tools({"tools": [ADD]}, HERMES)
    assert (req.choice, req.function, req.parallel, req.prefix) == ("auto", None, True, "")
    named = {"type": "function", "function": {"name": "add"}}
    req = parse_tools({"tools": [ADD], "tool_choice": named, "parallel_tool_calls": False}, HERMES)
    assert (req.choice, req.function, req.parallel) == ("function", "add", False)
    assert req.prefix == '<tool_call>\n{"name": "add", "arguments": '
    assert (
        parse_tools({"tools": [ADD], "tool_choice": "required"}, HERMES).prefix == "<tool_call>\n"
    )
    assert not parse_tools({"tools": [ADD], "tool_choice": "none"}, HERMES).parses


@pytest.mark.parametrize(
    ("body", "says", "param"),
    [
        ({"tools": [ADD, ADD]}, "tools[1]: a second function named 'add'", "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function must be an object", "tools"),
        ({"tools": [{"type": "retrieval"}]}, 'tools[0] must be {"type": "function"', "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must match", "tools"),
        ({"tools": "add"}, "tools must be a list", "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "strict=true needs constrained decoding",
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "parameters must be a JSON schema object",
            "tools",
        ),
        ({"tools": [ADD], "tool_choice": "always"}, "must be auto, none, required", "tool_choice"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice names 'mul', which is not among the tools (add)",
            "tool_choice",
        ),
        (
            {"tools": [ADD], "tool_choice": {"function": {"name": "add"}}},
            "must be {",
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice='required' needs tools", "tool_choice"),
        ({"parallel_tool_calls": 1}, "must be true or false", "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_refused_naming_the_problem(body, says, param):
    error = _refused(body)
    assert says in error.message and error.param == param


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "object", "properties": {"a": {"type": "int"}}}, "properties.a.type='int'"),
        ({"type": "object", "properties": []}, "properties must be an object"),
        ({"type": "object", "required": "a"}, "required must be a list"),
        ({"type": "array", "items": 3}, "items. must be an object"),
        ({"anyOf": []}, "anyOf must be a non-empty list"),
        ({"type": "string", "enum": []}, "enum must be a non-empty list"),
    ],
)
def test_a_bad_schema_is_named(schema, says):
    assert says in schema_problem(schema)
    error = _refused(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    )
    assert says in error.message


def test_a_good_schema_passes():
    schema = {
        "type": "object",
        "properties": {
            "q": {"type": ["string", "null"], "enum": ["a", None]},
            "xs": {"type": "array", "items": {"anyOf": [{"type": "integer"}, True]}},
        },
        "required": ["q"],
        "additionalProperties": False,
    }
    assert schema_problem(schema) is None


def test_history_calls_and_tool_answers_become_template_turns():
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    turns = chat_turns(messages)
    assert turns[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}, "id": "c1"}
        ],
    }
    assert turns[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    ids = chat_prompt(messages, _tokenizer(TOOL_TEMPLATE), None, "m")
    text = build_char_tokenizer().decode(ids)
    assert text == 'user:hi\nassistant:[add {"a": 1}]\ntool:1\na:'


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"role": "tool", "content": "1"}, "needs a tool_call_id"),
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
            "only an assistant",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "tool_calls[0].function.arguments must be a JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "needs a function with a name"),
    ],
)
def test_bad_tool_messages_are_refused(message, says):
    with pytest.raises(APIError, match="messages\\[1\\]") as caught:
        chat_turns([*USER, message])
    assert says in caught.value.message


def test_tools_need_a_template_that_renders_them():
    req = parse_tools({"tools": [ADD]}, HERMES)
    ids = chat_prompt(USER, _tokenizer(TOOL_TEMPLATE), req, "m")
    assert build_char_tokenizer().decode(ids) == "tools: add\nuser:hi\na:"
    plain = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
    with pytest.raises(APIError) as caught:
        chat_prompt(USER, _tokenizer(plain), req, "tiny-chat")
    assert caught.value.param == "tools"
    assert "the chat template of model 'tiny-chat' does not reference tools" in caught.value.message
    with pytest.raises(APIError, match="'tiny' has no chat template"):
        chat_prompt(USER, _tokenizer(None), req, "tiny")
    tool_answer = [*USER, {"role": "tool", "tool_call_id": "c", "content": "1"}]
    with pytest.raises(APIError, match="messages: the chat template of model"):
        chat_prompt(tool_answer, _tokenizer(plain), None, "tiny-chat")


def test_a_forced_call_opening_follows_the_generation_prompt():
    named = {"type": "function", "function": {"name": "add"}}
    req = parse_tools({"tools": [ADD], "tool_choice": named}, HERMES)
    text = build_char_tokenizer().decode(chat_prompt(USER, _tokenizer(TOOL_TEMPLATE), req, "m"))
    assert text.endswith('a:<tool_call>\n{"name": "add", "arguments": ')


def _choice(text: str, finish: str = "stop") -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}


CALLS = (
    'ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
)


def test_read_calls_fills_tool_calls_and_the_finish_reason():
    stats = {"tool_calls": 0, "tool_parse_failures": 0}
    choice = _choice(CALLS)
    read_calls(choice, parse_tools({"tools": [ADD]}, HERMES), stats)
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    one = _choice(CALLS[2:], "length")
    read_calls(one, parse_tools({"tools": [ADD], "parallel_tool_calls": False}, HERMES), stats)
    assert len(one["message"]["tool_calls"]) == 1 and one["message"]["content"] is None
    assert one["finish_reason"] == "length"  # a cut output says so, calls or not
    assert stats == {"tool_calls": 3, "tool_parse_failures": 0}


@pytest.mark.parametrize("size", [1, 5, 200])
def test_streamed_deltas_rebuild_the_calls_in_the_official_client(size):
    """Chunks built by ToolStream, accumulated by openai's own stream state."""
    stats = {"tool_calls": 0, "tool_parse_failures": 0}
    stream = ToolStream(parse_tools({"tools": [ADD]}, HERMES), stats)
    state = ChatCompletionStreamState()
    pieces = [CALLS[i : i + size] for i in range(0, len(CALLS), size)]
    for k, piece in enumerate(pieces):
        delta = {"content": piece, **({"role": "assistant"} if k == 0 else {})}
        done = "stop" if k == len(pieces) - 1 else None
        choice = stream.rewrite({"index": 0, "delta": delta, "finish_reason": done})
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        state.handle_chunk(ChatCompletionChunk.model_validate({**chunk, "choices": [choice]}))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "ok"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert got == [("add", {"a": 1}), ("add", {"a": 2})]
    assert stats["tool_calls"] == 2


def test_the_template_rlpost_adds_renders_tools():
    """A model ``rlpost sft`` gave its plain template can be served with tools."""
    from rlpost.data.conversations import ensure_chat_template
    from rlpost.models.tiny import build_char_tokenizer
    from rlpost.rollout.serve.tool_calls import chat_prompt, parse_tools
    from rlpost.rollout.serve.tool_parsers import tool_format

    tok = build_char_tokenizer()
    assert ensure_chat_template(tok)
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    tools = parse_tools({"tools": [tool]}, tool_format("hermes"))
    messages = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2}'}}],
        },
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    text = tok.decode(chat_prompt(messages, tok, tools, "m"))
    assert text.startswith("<|system|>\n# Tools\n") and '"name": "add"' in text
    assert '<call>add:{"a": 2}</call>' in text and text.endswith("<|assistant|>\n")
    plain = tok.decode(chat_prompt(messages[:1], tok, None, "m"))
    assert plain == "<|user|>\n2+3?\n<|assistant|>\n"  # no tools: no block
