"""Tool-call parsing: whole outputs, the same outputs streamed piece by piece, bad calls."""

from __future__ import annotations

import json

import pytest

from rlpost.rollout.serve.tool_parsers import (
    TOOL_PARSERS,
    CallParser,
    ParsedCall,
    parse_output,
    tool_format,
)

HERMES = tool_format("hermes")
TWO_CALLS = (
    "Let me add both.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": "x\\u00e9"}}\n</tool_call>'
)


def _streamed(fmt, text: str, size: int):
    """``text`` fed ``size`` characters at a time: (content, calls, failures)."""
    parser, content, calls = CallParser(fmt), "", []
    for i in range(0, len(text), size):
        part = parser.feed(text[i : i + size])
        content, calls = content + part.content, calls + part.calls
    rest = parser.finish()
    return content + rest.content, calls + rest.calls, parser.failures


def test_several_calls_in_one_turn():
    parsed, failures = parse_output(HERMES, TWO_CALLS)
    assert failures == 0
    assert parsed.content == "Let me add both."
    assert [c.name for c in parsed.calls] == ["add", "mul"]
    assert json.loads(parsed.calls[0].arguments) == {"a": 1, "b": 2}
    assert json.loads(parsed.calls[1].arguments) == {"a": 3, "b": "x\u00e9"}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_parse_as_the_whole_text(size):
    whole, failures = parse_output(HERMES, TWO_CALLS)
    content, calls, stream_failures = _streamed(HERMES, TWO_CALLS, size)
    assert (content, calls, stream_failures) == (whole.content, whole.calls, failures)


def test_arguments_as_an_object_or_as_json_text_read_the_same():
    as_object = '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>'
    as_text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    (a, _), (b, _) = parse_output(HERMES, as_object), parse_output(HERMES, as_text)
    assert a.calls == b.calls == [ParsedCall("f", '{"x": [1, 2]}')]
    assert a.content == b.content == ""


@pytest.mark.parametrize(
    "call",
    [
        '{"name": "f", "arguments": {"x": 1}',  # unbalanced
        '{"arguments": {"x": 1}}',  # no name
        '{"name": "f", "arguments": "not json"}',  # arguments text that is not JSON
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": {"x": NaN}}',  # no JSON spelling to hand back
        "plain words",
    ],
)
def test_a_malformed_call_stays_content_and_is_counted(call):
    text = f"before <tool_call>{call}</tool_call> after"
    parsed, failures = parse_output(HERMES, text)
    assert parsed.calls == [] and failures == 1
    assert parsed.content == text  # word for word, spaces included
    assert _streamed(HERMES, text, 3) == (text, [], 1)


def test_a_bad_call_does_not_spoil_a_good_one():
    good = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    text = "<tool_call>{oops</tool_call>" + good
    parsed, failures = parse_output(HERMES, text)
    assert [c.name for c in parsed.calls] == ["ok"] and failures == 1
    assert parsed.content == "<tool_call>{oops</tool_call>"


def test_an_unclosed_last_call_is_read_as_it_stands():
    parsed, failures = parse_output(HERMES, '<tool_call>{"name": "f", "arguments": {"q": 1}}')
    assert parsed.calls == [ParsedCall("f", '{"q": 1}')] and failures == 0
    truncated, failures = parse_output(HERMES, '<tool_call>{"name": "f", "argu')
    assert truncated.calls == [] and failures == 1
    assert truncated.content == '<tool_call>{"name": "f", "argu'


def test_text_that_only_looks_like_a_marker_is_content():
    text = "a <tool and <tool_cal b"
    parsed, failures = parse_output(HERMES, text)
    assert parsed.content == text and parsed.calls == [] and failures == 0
    assert _streamed(HERMES, text, 1) == (text, [], 0)


def test_a_marker_split_across_pieces_is_held_back():
    parser = CallParser(HERMES)
    assert parser.feed("hi <tool_").content == "hi"
    assert parser.feed('call>{"name": "f"}').content == ""
    done = parser.feed("</tool_call>")
    assert done.calls == [ParsedCall("f", "{}")] and done.content == ""


def test_the_functools_format_reads_a_list_to_the_end():
    fmt = TOOL_PARSERS["functools"]
    text = 'ok functools[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"k": 2}}]'
    parsed, failures = parse_output(fmt, text)
    assert parsed.content == "ok" and failures == 0
    assert parsed.calls == [ParsedCall("a", "{}"), ParsedCall("b", '{"k": 2}')]
    assert _streamed(fmt, text, 4)[1] == parsed.calls


def test_an_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: functools, hermes"):
        tool_format("nope")
