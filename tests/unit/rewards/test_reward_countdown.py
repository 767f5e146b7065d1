"""Countdown: safe parsing, number bookkeeping, exact arithmetic."""

from fractions import Fraction

import pytest

from rlpost.rewards.countdown import (
    EquationError,
    countdown,
    evaluate_equation,
    extract_equation,
)
from rlpost.types import RewardSample

META = {"numbers": [25, 5, 4, 7], "target": 80}


def score(completion: str, metadata=META, **params) -> float | None:
    return countdown(RewardSample("q", completion, metadata=dict(metadata)), **params)


def test_evaluate_precedence_and_exact_division():
    assert evaluate_equation("2 + 3 * 4") == (Fraction(14), [2, 3, 4])
    assert evaluate_equation("(2 + 3) * 4")[0] == 20
    assert evaluate_equation("(1 / 3) * 3")[0] == 1  # exact, no float residue
    assert evaluate_equation("10 - 4 - 3")[0] == 3  # left associative


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("5 / (3 - 3)", "division by zero"),
        ("__import__('os')", "invalid character"),
        ("2 ** 3", "expected a number"),
        ("-5 + 10", "expected a number"),  # no unary minus
        ("(2 + 3", "end of expression"),
        ("2 3", "unexpected"),
        ("(" * 40 + "1" + ")" * 40, "nested"),
        ("1+" * 200 + "1", "longer than"),
        ("2.5 * 2", "invalid character"),
    ],
)
def test_evaluate_rejects(text, reason):
    with pytest.raises(EquationError, match=reason):
        evaluate_equation(text)


def test_extract_equation():
    assert extract_equation("<answer> (25-5)*4 </answer>") == "(25-5)*4"
    assert extract_equation("so (25 - 5) * 4 = 80") == "(25 - 5) * 4"
    assert extract_equation("80 = (25-5)*4") == "(25-5)*4"
    assert extract_equation("nothing to see, 80") is None


def test_correct_and_incorrect():
    assert score("<think>try</think><answer>(25 - 5) * 4</answer>") == 1.0
    assert score("<answer>(25 - 7) * 4</answer>") == 0.0
    assert score("<answer>(25 - 7) * 4</answer>", format_score=0.1) == 0.1
    assert score("I think (25-5)*4 = 80") == 1.0


def test_reused_number_and_unknown_number():
    assert score("<answer>(25 - 5) * 4 * 1</answer>") == 0.0  # 1 is not given
    assert score("<answer>25 + 25 + 25 + 5</answer>") == 0.0  # 25 used three times
    twice = {"numbers": [25, 25, 5, 25], "target": 80}
    assert score("<answer>25 + 25 + 25 + 5</answer>", twice) == 1.0


def test_exactly_once():
    assert score("<answer>(25 - 5) * 4</answer>", exactly_once=True) == 0.0  # 7 unused
    assert score("<answer>(25 - 5) * 4 + 7 - 7</answer>", exactly_once=True) == 0.0  # 7 twice
    meta = {"numbers": [25, 5, 4, 7], "target": 87}
    assert score("<answer>(25 - 5) * 4 + 7</answer>", meta, exactly_once=True) == 1.0


def test_invalid_characters_division_by_zero_and_empty():
    assert score("<answer>(25 - 5) * 4 # comment</answer>") == 0.0
    assert score("<answer>import os</answer>") == 0.0
    assert score("<answer>80 / (5 - 5)</answer>") == 0.0
    assert score("") == 0.0


def test_not_applicable_and_bad_metadata():
    assert score("(25-5)*4", metadata={}) is None
    with pytest.raises(ValueError, match="bad metadata"):
        score("(25-5)*4", metadata={"numbers": ["x"], "target": 80})
