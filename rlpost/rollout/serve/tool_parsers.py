"""Tool-call formats: how a model writes a call, and how its text becomes ``tool_calls``.

Each :class:`CallFormat` is registered by name in ``TOOL_PARSERS`` (``rlpost serve
--tool-parser NAME``). One :class:`CallParser` reads any format a piece of text at a time, so
a streamed and a whole response are parsed by the same code and always agree. As with vLLM's
``hermes`` parser, a call that does not decode stays in the content word for word (and counts
as a parse failure); unlike vLLM, text between and after calls is content too, less the
whitespace next to a call, and a call's arguments arrive whole, never as partial JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from rlpost.data import safe_json


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str  # a JSON object, serialised


@dataclass(frozen=True)
class CallFormat:
    """A model family's way of writing calls.

    ``decode(body)`` turns the text between ``start`` and ``end`` into calls,
    or None when it is not a valid call. ``required_prefix`` and
    ``named_prefix(name)`` open a call the model must complete
    (``tool_choice`` ``required`` and a named function)."""

    name: str
    start: str
    end: str | None
    decode: Callable[[str], list[ParsedCall] | None]
    required_prefix: str
    named_prefix: Callable[[str], str]


def _call(obj) -> ParsedCall | None:
    """``{"name": str, "arguments": object | JSON text of one}`` -> a call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    try:  # NaN and Infinity parse, but have no JSON spelling to hand back
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


def _loads(text: str):
    try:
        return safe_json.loads(text)
    except (ValueError, safe_json.TooDeep):  # JSONDecodeError, too deep, huge numbers
        return None


def _one_object(body: str) -> list[ParsedCall] | None:
    call = _call(_loads(body.strip()))
    return None if call is None else [call]


def _object_list(body: str) -> list[ParsedCall] | None:
    items = _loads(body.strip())
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item) for item in items]
    return None if any(c is None for c in calls) else calls


TOOL_PARSERS: dict[str, CallFormat] = {}


def register(fmt: CallFormat) -> CallFormat:
    TOOL_PARSERS[fmt.name] = fmt
    return fmt


def _opening(start: str):
    """A named call's opening in a format whose calls are ``{"name": ..., "arguments": ...}``."""
    return lambda name: start + '{"name": ' + json.dumps(name) + ', "arguments": '


# Hermes 2 Pro, Qwen 2.5 / Qwen 3 and most open chat models with a tool template.
register(
    CallFormat(
        "hermes",
        "<tool_call>",
        "</tool_call>",
        _one_object,
        "<tool_call>\n",
        _opening("<tool_call>\n"),
    )
)
# Phi-4-mini: ``functools[{...}, {...}]`` to the end of the output.
register(
    CallFormat("functools", "functools", None, _object_list, "functools[", _opening("functools["))
)


def tool_format(name: str) -> CallFormat:
    """The registered format ``name``; a ValueError listing the names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


@dataclass
class Parsed:
    """What a piece of text adds: content to show and calls completed by it."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class CallParser:
    """Splits a model's output into content and calls, a piece of text at a time.

    ``feed(text)`` returns what can be decided so far; ``finish()`` what is
    left (an unclosed last call is decoded as it stands). Text that may still
    begin a call marker, and whitespace that may still precede a call, are
    held back until the next piece decides them."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.in_call = False
        self.after_call = False  # drop the whitespace that follows a call
        self.space = ""  # whitespace held before a call marker, given back if it fails
        self.calls = 0
        self.failures = 0

    def feed(self, text: str) -> Parsed:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> Parsed:
        return self._drain(final=True)

    def _drain(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self.in_call:
                if not self._close(out, final):
                    return out
                continue
            if self.after_call:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.after_call = False
            k = self.buf.find(self.fmt.start)
            if k >= 0:
                text = self.buf[:k]
                kept = text.rstrip()
                out.content += kept
                self.space = text[len(kept) :]
                self.buf, self.in_call = self.buf[k + len(self.fmt.start) :], True
                continue
            if final:
                out.content, self.buf = out.content + self.buf, ""
                return out
            keep = len(self.buf) - _marker_tail(self.buf, self.fmt.start)
            sent = self.buf[:keep].rstrip()
            out.content += sent
            self.buf = self.buf[len(sent) :]
            return out

    def _close(self, out: Parsed, final: bool) -> bool:
        """Decode the open call if its end is here; False while it is still being written."""
        end = self.fmt.end
        k = -1 if end is None else self.buf.find(end)
        if k < 0 and not final:
            return False
        body, closing = (self.buf, "") if k < 0 else (self.buf[:k], end)
        self.buf = "" if k < 0 else self.buf[k + len(end) :]
        self.in_call = False
        calls = self.fmt.decode(body)
        if calls is None:
            self.failures += 1
            out.content += self.space + self.fmt.start + body + closing
        else:
            self.calls += len(calls)
            out.calls += calls
            self.after_call = True
        self.space = ""
        return True


def _marker_tail(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_output(fmt: CallFormat, text: str) -> tuple[Parsed, int]:
    """A whole output -> (content and calls, parse failures)."""
    parser = CallParser(fmt)
    first, rest = parser.feed(text), parser.finish()
    return Parsed(first.content + rest.content, first.calls + rest.calls), parser.failures
