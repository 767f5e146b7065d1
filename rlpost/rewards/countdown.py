"""Countdown: reach a target with the given numbers and + - * / and parentheses.

TinyZero's task (Pan et al., 2025). Model output never reaches ``eval``: a recursive-descent
parser evaluates it in exact ``Fraction`` arithmetic.

Grammar (integers only, no unary minus, no exponent)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INT | "(" expr ")"
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from rlpost.rewards.registry import reward_function
from rlpost.rewards.verifiable import extract_tag, numbers_bounded
from rlpost.types import RewardSample

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_EQUATION_RUN = re.compile(r"[\d\s+\-*/()=]+")
# Bounds keep a hostile completion from costing more than a few microseconds.
MAX_CHARS = 300
MAX_DEPTH = 32
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class EquationError(ValueError):
    """The text is not a well-formed countdown expression (one line says why)."""


class _Parser:
    """Recursive-descent parser over a list of tokens; records the numbers used."""

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        for m in _TOKEN.finditer(text):
            number, other = m.groups()
            if other is not None and other not in "+-*/()":
                raise EquationError(f"invalid character {other!r}")
            self.tokens.append(number if number is not None else other)
        self.pos = 0
        self.numbers: list[int] = []

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise EquationError("unexpected end of expression")
        self.pos += 1
        return token

    def parse(self) -> Fraction:
        value = self._expr(0)
        if self._peek() is not None:
            raise EquationError(f"unexpected {self._peek()!r}")
        return value

    def _chain(self, depth: int, ops: tuple[str, str], operand) -> Fraction:
        """``operand (op operand)*`` for the two operators of one precedence level."""
        value = operand(depth)
        while self._peek() in ops:
            op = self._take()
            rhs = operand(depth)
            if op == "/" and rhs == 0:
                raise EquationError("division by zero")
            value = _APPLY[op](value, rhs)
        return value

    def _expr(self, depth: int) -> Fraction:
        return self._chain(depth, ("+", "-"), self._term)

    def _term(self, depth: int) -> Fraction:
        return self._chain(depth, ("*", "/"), self._factor)

    def _factor(self, depth: int) -> Fraction:
        token = self._take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise EquationError("parentheses nested too deeply")
            value = self._expr(depth + 1)
            if self._take() != ")":
                raise EquationError("missing ')'")
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise EquationError(f"expected a number or '(', got {token!r}")


def evaluate_equation(text: str) -> tuple[Fraction, list[int]]:
    """``(value, numbers used in order)``, or ``EquationError`` (bad text, division by zero,
    over ``MAX_CHARS``)."""
    if len(text) > MAX_CHARS:
        raise EquationError(f"expression longer than {MAX_CHARS} characters")
    parser = _Parser(text)
    return parser.parse(), parser.numbers


def extract_equation(completion: str, tag: str | None = "answer") -> str | None:
    """The last ``<tag>`` block verbatim, else the last run of digits, operators and
    parentheses holding an operator; of ``lhs = rhs`` the side with an operator."""
    block = extract_tag(completion, tag) if tag else None
    if block is None:
        runs = [r for r in _EQUATION_RUN.findall(completion) if re.search(r"\d\s*[-+*/]", r)]
        if not runs:
            return None
        block = runs[-1]
    sides = block.split("=")
    with_operator = [s for s in sides if re.search(r"[-+*/]", s)]
    return (with_operator[0] if with_operator else sides[0]).strip()


def _uses_allowed_numbers(used: list[int], given: list[int], exactly_once: bool) -> bool:
    used_count, given_count = Counter(used), Counter(given)
    if exactly_once:
        return used_count == given_count
    return all(used_count[n] <= given_count[n] for n in used_count)


def _metadata_numbers(metadata: dict[str, Any]) -> tuple[list[int], Fraction] | float | None:
    """(numbers, target) of a row; NaN (an invalid score) for a target too large to read."""
    numbers, target = metadata.get("numbers"), metadata.get("target")
    if numbers is None or target is None:
        return None
    if not numbers_bounded(str(target)):
        return math.nan
    try:
        return [int(n) for n in numbers], Fraction(target)
    except (TypeError, ValueError):
        raise ValueError(f"countdown: bad metadata numbers={numbers!r} target={target!r}") from None


@reward_function("countdown")
def countdown(
    sample: RewardSample,
    *,
    exactly_once: bool = False,
    format_score: float = 0.0,
    tag: str | None = "answer",
) -> float | None:
    """1.0 if the proposed equation uses the given numbers legally and hits the target.

    Needs ``metadata["numbers"]`` and ``["target"]`` (else ``None``). A legal equation with
    the wrong value scores ``format_score``; a target past
    :func:`~rlpost.rewards.verifiable.numbers_bounded` scores NaN."""
    spec = _metadata_numbers(sample.metadata)
    if not isinstance(spec, tuple):
        return spec
    given, target = spec
    equation = extract_equation(sample.completion, tag)
    if not equation:
        return 0.0
    try:
        value, used = evaluate_equation(equation)
    except EquationError:
        return 0.0
    if not _uses_allowed_numbers(used, given, exactly_once):
        return 0.0
    return 1.0 if value == target else format_score
