"""A calculator agent written against the OpenAI API alone (it does not import rlpost).

One ``calc`` tool, run by the agent itself; trained through its base URL (recipe
``agent_blackbox``). As a command it reads ``OPENAI_BASE_URL`` and the prompt on stdin.
``demonstration`` writes the warm-up's conversations.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

import httpx
from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "description": "e.g. 347*829"}},
                "required": ["x"],
            },
        },
    }
]
HTTP = httpx.Client(timeout=60)  # one connection pool for every conversation this process has
OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calc(expression: str) -> str:
    """The value of an arithmetic expression (integers, + - * // %, parentheses)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    return str(value(ast.parse(expression, mode="eval").body))


def run(prompt: str, base_url: str, api_key: str = "none", max_turns: int = 3) -> str:
    """Solve ``prompt`` with the model at ``base_url``; the final answer's text."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    content = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=96
        )
        message = reply.choices[0].message
        content = message.content or ""
        if not message.tool_calls:
            return content
        calls = [c.model_dump() for c in message.tool_calls]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        for call in message.tool_calls:
            try:
                result = calc(json.loads(call.function.arguments)["x"])
            except Exception as exc:  # the model sees its mistake
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return content


def demonstration(prompt: str, answer, rng, direct: float = 0.5) -> dict | None:
    """A warm-up conversation for ``prompt`` ("347*829="): a call, its result, the answer;
    a ``direct`` fraction answers without the tool."""
    expression = prompt.rstrip("=").strip()
    messages: list[dict] = [{"role": "user", "content": prompt}]
    if rng.random() >= direct:
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calc", "arguments": json.dumps({"x": expression})},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": calc(expression)})
    messages.append({"role": "assistant", "content": str(answer)})
    return {"messages": messages, "tools": TOOLS}


if __name__ == "__main__":
    question = sys.stdin.read().strip() or os.environ.get("RLPOST_PROMPT", "")
    print(run(question, os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", "none")))
