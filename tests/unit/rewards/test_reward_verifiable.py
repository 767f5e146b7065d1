"""Exact and numeric match: the answer checks every arithmetic recipe relies on."""

import math

import pytest

from rlpost.rewards.verifiable import (
    exact_match,
    extract_first_number,
    extract_last_number,
    extract_tag,
    numeric_match,
)
from rlpost.types import RewardSample


def sample(completion: str, answer: object = "42") -> RewardSample:
    return RewardSample(prompt="q", completion=completion, answer=answer)


@pytest.mark.parametrize(
    ("text", "first", "last"),
    [
        ("5-3", 5.0, 3.0),  # a minus between digits is an operator, not a sign
        ("x = -4.5", -4.5, -4.5),
        ("1,000,000 apples", 1e6, 1e6),
        ("1,2,3", 1.0, 3.0),  # not a thousands group
        ("The answer is 42.", 42.0, 42.0),
        ("2.5e3 then 7", 2500.0, 7.0),
        ("no digits here", None, None),
        ("", None, None),
        ("1e999", None, None),  # overflows to inf: not a usable number
    ],
)
def test_extract_numbers(text, first, last):
    assert extract_first_number(text) == first
    assert extract_last_number(text) == last


def test_numeric_match_first_and_last():
    s = sample("42, or maybe 41")
    assert numeric_match(s) == 1.0
    assert numeric_match(s, position="last") == 0.0


def test_numeric_match_edge_cases():
    assert numeric_match(sample("")) == 0.0  # empty completion
    assert numeric_match(sample("I cannot say")) == 0.0  # unparsable answer
    assert numeric_match(sample("1,000", answer="1000")) == 1.0
    assert numeric_match(sample("1000", answer=" 1,000 ")) == 1.0
    assert numeric_match(sample("0.5", answer=0.5)) == 1.0
    assert numeric_match(sample("42", answer=None)) is None
    assert numeric_match(sample("42", answer="forty-two")) is None
    assert numeric_match(sample("42", answer=math.nan)) is None
    assert numeric_match(sample("1", answer=True)) is None


def test_numeric_match_tag_and_bad_position():
    s = sample("I try 7 first. <answer>42</answer>")
    assert numeric_match(s, tag="answer") == 1.0
    assert numeric_match(sample("42"), tag="answer") == 0.0  # tag required but missing
    with pytest.raises(ValueError, match="position"):
        numeric_match(s, position="middle")


def test_exact_match_options():
    assert exact_match(sample(" Paris \n", answer="Paris")) == 1.0
    assert exact_match(sample("paris", answer="Paris")) == 0.0
    assert exact_match(sample("paris", answer="Paris"), ignore_case=True) == 1.0
    assert exact_match(sample("New  York", answer="New York"), collapse_space=True) == 1.0
    assert exact_match(sample("NYC", answer=["New York", "NYC"])) == 1.0
    assert exact_match(sample("", answer="x")) == 0.0
    assert exact_match(sample("x", answer=None)) is None
    assert exact_match(sample("<answer>x</answer>", answer="x"), tag="answer") == 1.0


def test_extract_tag_takes_last_block():
    assert extract_tag("<a>1</a> <a>2\n3</a>", "a") == "2\n3"
    assert extract_tag("<a>1", "a") is None
