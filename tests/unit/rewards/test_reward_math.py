"""math_verify: equivalent LaTeX forms score 1, different values and garbage 0."""

import threading

import pytest

from rlpost.rewards.math import math_verify_reward
from rlpost.types import RewardSample


def score(completion: str, answer: object, **params) -> float | None:
    return math_verify_reward(RewardSample("q", completion, answer=answer), **params)


@pytest.mark.parametrize(
    ("answer", "completion"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"The answer is \boxed{\tfrac12}"),
        (r"\frac{1}{2}", r"so it is $\frac12$."),
        (r"\boxed{\tfrac12}", r"\boxed{\dfrac{1}{2}}"),
        ("x^2+1", r"\boxed{1 + x^2}"),
        (r"\sqrt{2}/2", r"\boxed{\frac{\sqrt{2}}{2}}"),
        (3, r"\boxed{3}"),
    ],
)
def test_equivalent_forms_score_one(answer, completion):
    assert score(completion, answer) == 1.0


@pytest.mark.parametrize("completion", ["", "   ", "no idea", r"\boxed{\frac{1}{3}}", r"\boxed{"])
def test_wrong_or_unparsable_scores_zero(completion):
    assert score(completion, "0.5") == 0.0


def test_not_applicable_without_answer():
    assert score(r"\boxed{1}", None) is None
    assert score(r"\boxed{1}", "  ") is None


def test_tag_restricts_the_answer():
    text = r"<think>maybe \boxed{2}</think><answer>\frac{1}{2}</answer>"
    assert score(text, "0.5", tag="answer") == 1.0
    assert score(r"\boxed{0.5}", "0.5", tag="answer") == 0.0


def test_works_off_the_main_thread():
    # math-verify's signal-based timeout raises off the main thread; ours must not.
    out = []
    t = threading.Thread(target=lambda: out.append(score(r"\boxed{\tfrac12}", "0.5")))
    t.start()
    t.join(timeout=30)
    assert out == [1.0]


def test_a_short_pathological_answer_cannot_stall_a_scoring_thread():
    """sympy can spend minutes on 10^10^10; off the main thread the check runs in a helper
    process that math-verify's timeout bounds (and that is killed if it overruns)."""
    out = []
    t = threading.Thread(
        target=lambda: out.append(score(r"\boxed{10^{10^{10}}}", "5", timeout_seconds=2))
    )
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and out == [0.0]
    # the helper still answers afterwards
    t = threading.Thread(target=lambda: out.append(score(r"\boxed{\tfrac12}", "0.5")))
    t.start()
    t.join(timeout=60)
    assert out == [0.0, 1.0]
