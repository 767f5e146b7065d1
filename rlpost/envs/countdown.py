"""``countdown``: reach the target in checked steps, then state the whole expression.

Each tool call combines two available numbers (``<step>25+5</step>``) into an exact integer,
earning ``step_reward`` or costing ``error_penalty``; a legal step uses up a number, so the
shaping is bounded. A turn without a call is the answer, judged by the ``countdown`` reward.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from fractions import Fraction

from rlpost.envs.base import Action, Demonstration, StepResult, ToolCall, environment
from rlpost.rewards.countdown import EquationError, evaluate_equation
from rlpost.types import Prompt


@environment("countdown")
class CountdownSteps:
    """Countdown with one checked binary step per call."""

    tools = ("step",)

    def __init__(self, *, step_reward: float = 0.1, error_penalty: float = 0.1) -> None:
        self.step_reward = step_reward
        self.error_penalty = error_penalty

    def reset(self, prompt: Prompt) -> None:
        self.numbers = [int(n) for n in prompt.metadata.get("numbers", [])]
        self.target = prompt.metadata.get("target")

    def _left(self) -> str:
        return " ".join(str(n) for n in self.numbers)

    def step(self, action: Action) -> StepResult:
        if action.call is None:
            return StepResult(done=True)
        try:
            value, used = evaluate_equation(action.call.arguments)
            if len(used) != 2:
                raise EquationError("a step combines exactly two numbers")
            missing = Counter(used) - Counter(self.numbers)
            if missing:
                raise EquationError(f"{min(missing)} is not available")
            if value.denominator != 1 or value < 0:
                raise EquationError("a step must give a non-negative whole number")
        except EquationError as exc:
            return StepResult(
                f"error: {exc}; numbers: {self._left()}", reward=-self.error_penalty, error=True
            )
        for n in used:
            self.numbers.remove(n)
        self.numbers.append(int(value))
        note = " (target reached)" if int(value) == self.target else ""
        return StepResult(f"{int(value)}{note}; numbers: {self._left()}", reward=self.step_reward)

    def demonstration(self, prompt: Prompt, rng: random.Random) -> Demonstration | None:
        """A solution found by search: its steps, then the whole expression as the answer."""
        numbers, target = prompt.metadata.get("numbers"), prompt.metadata.get("target")
        if numbers is None or target is None:
            return None
        found = solve(list(numbers), int(target))
        if found is None:
            return None
        steps, expression = found
        return [*(ToolCall("step", s) for s in steps), f"<answer>{expression}</answer>"]


def solve(numbers: list[int], target: int) -> tuple[list[str], str] | None:
    """(steps, expression) reaching ``target`` with + - * / on whole numbers, or None
    (exhaustive over pairs)."""
    items = [(Fraction(n), str(n)) for n in numbers]

    def search(items, steps):
        if any(v == target for v, _ in items):
            return steps, next(e for v, e in items if v == target)
        for (i, (a, ea)), (j, (b, eb)) in itertools.permutations(enumerate(items), 2):
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            for op in "+-*/":
                if op == "/" and (b == 0 or (a / b).denominator != 1):
                    continue
                value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
                if value < 0:
                    continue
                step = f"{int(a)}{op}{int(b)}"
                found = search([*rest, (value, f"({ea}{op}{eb})")], [*steps, step])
                if found is not None:
                    return found
        return None

    found = search(items, [])
    if found is None:
        return None
    steps, expression = found
    return steps, expression[1:-1] if expression.startswith("(") else expression
