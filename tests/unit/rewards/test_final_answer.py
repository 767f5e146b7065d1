"""GSM8K's ``#### 42`` and ``\\boxed{}`` answers, in references and completions (CPU)."""

from __future__ import annotations

import pytest

from rlpost.rewards.math import math_verify_reward
from rlpost.rewards.verifiable import extract_boxed, extract_final_answer, numeric_match
from rlpost.types import RewardSample

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


def _s(completion, answer=GSM8K_ANSWER):
    return RewardSample(prompt="q", completion=completion, answer=answer)


def test_extraction():
    assert extract_final_answer(GSM8K_ANSWER) == "72"
    assert extract_final_answer("so \\boxed{\\frac{1}{2}} and") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{a{b}c} then \\boxed{7}") == "7"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_final_answer("no marker 3") is None
    assert extract_final_answer("#### 1,234\nmore") == "1,234"


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("She sold 24 in May, 72 in all.\n#### 72", 1.0),
        ("48 + 24 gives \\boxed{72}", 1.0),
        ("48 + 24 = 72", 0.0),  # position=first reads 48: no marker, no mercy
        ("In May 24. #### 71", 0.0),
        ("#### ", 0.0),
    ],
)
def test_numeric_match_reads_markers_in_reference_and_completion(completion, score):
    assert numeric_match(_s(completion)) == score


def test_numeric_match_with_a_plain_reference_still_reads_the_marker():
    assert numeric_match(_s("I think 5 then \\boxed{1,000}", answer=1000)) == 1.0
    assert numeric_match(_s("not a number", answer="see the proof")) is None


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("reasoning 3 + 4 ... #### 72", 1.0),
        ("\\boxed{72}", 1.0),
        ("reasoning ... #### 70", 0.0),
        ("####", 0.0),
    ],
)
def test_math_verify_reads_gsm8k_answers(completion, score):
    assert math_verify_reward(_s(completion)) == score


def test_math_verify_boxed_fraction_against_a_marked_reference():
    assert math_verify_reward(_s("\\boxed{\\frac{1}{2}}", answer="work\n#### 0.5")) == 1.0
