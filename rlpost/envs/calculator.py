"""``calc``: a calculator tool for the arithmetic task.

``<calc>347*829</calc>`` is parsed with :mod:`ast`: only number literals, ``+ - * / // %``,
unary minus and parentheses (no ``**``: ``9**9**9`` would hang). A turn without a call is the
answer.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from rlpost.envs.base import Action, Demonstration, StepResult, ToolCall, environment
from rlpost.types import Prompt

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_CHARS = 200
MAX_MAGNITUDE = 10**30  # keeps a chain of products from building a huge integer
_EXPRESSION = re.compile(r"[\d\s.+\-*/%()]*\d[\d\s.+\-*/%()]*")


def calculate(text: str) -> int | float:
    """The value of an arithmetic expression; ValueError (one line) when it is not one."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text.strip()[:40]!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported element {type(node).__name__} in the expression")


def _show(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@environment("calc")
class Calculator:
    """A calculator tool: ``calc`` answers the value of an arithmetic expression."""

    tools = ("calc",)

    def __init__(self, *, call_reward: float = 0.0) -> None:
        self.call_reward = call_reward  # a per-call shaping reward (0: outcome only)

    def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt

    def step(self, action: Action) -> StepResult:
        if action.call is None:
            return StepResult(done=True)
        try:
            value = calculate(action.call.arguments)
        except ValueError as exc:
            return StepResult(f"error: {exc}", error=True)
        return StepResult(_show(value), reward=self.call_reward)

    def demonstration(self, prompt: Prompt, rng: random.Random) -> Demonstration | None:
        """Call the calculator on the problem's expression, then state its value."""
        found = [m.strip() for m in _EXPRESSION.findall(prompt.text) if re.search(r"\d\s*\D", m)]
        if not found or prompt.answer is None:
            return None
        return [ToolCall("calc", found[0].rstrip("= ")), str(prompt.answer)]
