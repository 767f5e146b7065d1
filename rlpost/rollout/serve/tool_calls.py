"""Tool calls on ``/v1/chat/completions``: the request's tools, the chat, the model's calls.

Tools are rendered by the tokenizer's chat template and calls parsed back by the server's
format (:mod:`rlpost.rollout.serve.tool_parsers`). No constrained decoding: ``required`` and a
named function write a call's opening into the prompt; an unparsable completion stays content.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from rlpost.data import safe_json
from rlpost.rollout.serve.openai_params import APIError, checked_text, content_text, shown
from rlpost.rollout.serve.tool_parsers import CallFormat, CallParser, ParsedCall, parse_output

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools and how its output is read."""

    tools: list[dict]  # as the client sent them: the template renders these
    choice: str  # "auto", "none", "required" or "function"
    function: str | None  # the function tool_choice names
    parallel: bool  # False: at most one call is returned
    fmt: CallFormat

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def prefix(self) -> str:
        """The text a forced call begins with (written into the prompt)."""
        if self.choice == "required":
            return self.fmt.required_prefix
        return self.fmt.named_prefix(self.function) if self.choice == "function" else ""


def parse_tools(body: dict, fmt: CallFormat) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    tools = [] if tools is None else tools
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        why = f"parallel_tool_calls must be true or false, got {shown(parallel)}"
        raise APIError(400, why, "parallel_tool_calls")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice={shown(choice)} needs tools", "tool_choice")
        return None
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = _tool_name(tool, i)
        if name in names:
            raise APIError(400, f"tools[{i}]: a second function named {name!r}", "tools")
        names.append(name)
    kind, function = _choice(choice, names)
    return ToolRequest(tools, kind, function, parallel is not False, fmt)


def _tool_name(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise APIError(400, f"{where}.function must be an object with a name", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        why = f"{where}.function.name={shown(name)} must match [A-Za-z0-9_-]{{1,64}}"
        raise APIError(400, why, "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise APIError(400, f"{where}.function.description must be a string", "tools")
    if fn.get("strict"):
        why = "needs constrained decoding, which this server does not have; leave strict unset"
        raise APIError(400, f"{where}.function.strict=true {why}", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object", "tools")
    problem = None if params is None else schema_problem(params)
    if problem is not None:
        raise APIError(400, f"{where}.function.parameters: {problem}", "tools")
    return name


def schema_problem(schema: Any, path: str = "") -> str | None:
    """Why ``schema`` is not a JSON schema (the keywords a tool's parameters use), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path or 'the schema'} must be an object, got {shown(schema)}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        return f"{path}type={shown(kind)} is not a JSON type ({', '.join(sorted(JSON_TYPES))})"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return f"{path}properties must be an object of schemas"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{path}required must be a list of property names"
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        return f"{path}enum must be a non-empty list"
    subs = [(f"{path}properties.{k}.", v) for k, v in props.items()]
    for key in ("items", "additionalProperties", "not"):
        if key in schema:
            subs.append((f"{path}{key}.", schema[key]))
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                return f"{path}{key} must be a non-empty list of schemas"
            subs += [(f"{path}{key}[{j}].", s) for j, s in enumerate(schema[key])]
    for sub_path, sub in subs:
        problem = schema_problem(sub, sub_path)
        if problem is not None:
            return problem
    return None


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    named_form = '{"type": "function", "function": {"name": ...}}'
    if isinstance(choice, str):
        if choice not in CHOICES:
            why = f"tool_choice={shown(choice)} must be auto, none, required or {named_form}"
            raise APIError(400, why, "tool_choice")
        return choice, None
    named = isinstance(choice, dict) and choice.get("type") == "function"
    fn = choice.get("function") if named else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, f"tool_choice={shown(choice)} must be {named_form}", "tool_choice")
    if name not in names:
        why = f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})"
        raise APIError(400, why, "tool_choice")
    return "function", name


def chat_turns(messages: Any) -> list[dict]:
    """OpenAI messages -> the turns a Hugging Face chat template takes."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] needs a string role and content", "messages")
        role = checked_text(m["role"], f"messages[{i}].role")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            why = f"messages[{i}].tool_calls must be a list of calls, got {shown(calls)}"
            raise APIError(400, why, "messages")
        if calls and role != "assistant":
            why = f"messages[{i}]: only an assistant message has tool_calls"
            raise APIError(400, why, "messages")
        content = m.get("content")
        turn: dict = {"role": role, "content": "" if content is None and calls else None}
        if turn["content"] is None:
            turn["content"] = content_text(content, i)
        if calls:
            turn["tool_calls"] = [_history_call(c, i, j) for j, c in enumerate(calls)]
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                why = f"messages[{i}]: a tool message needs a tool_call_id"
                raise APIError(400, why, "messages")
            turn["tool_call_id"] = checked_text(call_id, f"messages[{i}].tool_call_id")
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise APIError(400, f"messages[{i}].name must be a string", "messages")
            turn["name"] = checked_text(m["name"], f"messages[{i}].name")
        turns.append(turn)
    return turns


def _history_call(call: Any, i: int, j: int) -> dict:
    """An earlier call, as templates render it: ``function.arguments`` an object."""
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs a function with a name and arguments", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = safe_json.loads(checked_text(args, f"{where}.function.arguments"))
        except ValueError:  # JSONDecodeError, TooDeep
            args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", "messages")
    turn = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        turn["id"] = call["id"]
    return turn


def chat_prompt(messages: Any, tokenizer, tools: ToolRequest | None, model: str) -> list[int]:
    """Token ids of a chat: the tokenizer's chat template, or ``role: content`` lines without one
    (then no tools); a forced call's opening follows the generation prompt."""
    turns = chat_turns(messages)
    uses_tools = tools is not None or any(t.get("tool_calls") or t["role"] == "tool" for t in turns)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" for tools
        template = template.get("tool_use") or template.get("default") or ""
    param = "tools" if tools is not None else "messages"
    if uses_tools and not template:
        why = f"model {model!r} has no chat template, so it cannot be given tools"
        raise APIError(400, f"{param}: {why}", param)
    if uses_tools and "tools" not in template:
        why = f"the chat template of model {model!r} does not reference tools, so it cannot "
        why += "render them; serve a checkpoint whose template supports tools"
        raise APIError(400, f"{param}: {why}", param)
    if not template:
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "
        return _nonempty(tokenizer(text, add_special_tokens=False)["input_ids"])
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            turns, tools=tools.tools if tools else None, add_generation_prompt=True, tokenize=True
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise APIError(
            400, f"messages: the chat template refused them ({line})", "messages"
        ) from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if tools is not None and tools.parses and tools.prefix:
        ids += tokenizer(tools.prefix, add_special_tokens=False)["input_ids"]
    return _nonempty(ids)


def _nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise APIError(400, "messages are empty: the prompt has no tokens", "messages")
    return list(ids)


def _wire(call: ParsedCall, index: int | None = None) -> dict:
    """A call in OpenAI's form (``index`` for a streamed delta)."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
    out["function"] = {"name": call.name, "arguments": call.arguments}
    return out if index is None else {"index": index, **out}


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason not in (None, "length") else reason


def read_calls(choice: dict, tools: ToolRequest, stats: dict) -> None:
    """Turn a whole chat choice's text into content and ``tool_calls``, in place."""
    message = choice["message"]
    parsed, failures = parse_output(tools.fmt, tools.prefix + message["content"])
    calls = parsed.calls if tools.parallel else parsed.calls[:1]
    stats["tool_calls"] += len(calls)
    stats["tool_parse_failures"] += failures
    message["content"] = parsed.content if parsed.content or not calls else None
    if calls:
        message["tool_calls"] = [_wire(c) for c in calls]
    choice["finish_reason"] = _finish(choice["finish_reason"], bool(calls))


class ToolStream:
    """One streamed chat choice read for calls: each delta's text goes through a parser."""

    def __init__(self, tools: ToolRequest, stats: dict) -> None:
        self.tools, self.stats = tools, stats
        self.parser = CallParser(tools.fmt)
        self.sent = 0  # calls sent so far: the next call's index
        self.parser.feed(tools.prefix)  # the forced opening is prompt, never content

    def rewrite(self, choice: dict) -> dict:
        """``choice`` (a chunk's) with its content split into content and call deltas."""
        delta, done = choice["delta"], choice["finish_reason"] is not None
        parsed = self.parser.feed(delta.get("content") or "")
        if done:
            rest = self.parser.finish()
            parsed.content += rest.content
            parsed.calls += rest.calls
            self.stats["tool_parse_failures"] += self.parser.failures
        calls = parsed.calls if self.tools.parallel else parsed.calls[: max(0, 1 - self.sent)]
        delta["content"] = parsed.content
        if calls:
            delta["tool_calls"] = [_wire(c, self.sent + k) for k, c in enumerate(calls)]
            self.sent += len(calls)
            self.stats["tool_calls"] += len(calls)
            if not parsed.content:
                del delta["content"]
        if done:
            choice["finish_reason"] = _finish(choice["finish_reason"], self.sent > 0)
        return choice
