"""mean@k, pass@k and maj@k against values computed by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlpost.algos.eval_metrics import (
    maj_at_k,
    majority_index,
    mean_at_k,
    parse_metric,
    pass_at_k,
    problem_metric,
)

# 1 - C(8-c, k) / C(8, k), written out: C(8,1)=8, C(8,4)=70, C(8,8)=1.
PASS_8 = {
    1: [Fraction(c, 8) for c in range(9)],
    4: [1 - Fraction(n, 70) for n in (70, 35, 15, 5, 1, 0, 0, 0, 0)],  # C(8-c, 4)
    8: [Fraction(0)] + [Fraction(1)] * 8,
}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("c", range(9))
def test_pass_at_k_n8_matches_hand_values(c, k):
    assert pass_at_k(8, c, k) == pytest.approx(float(PASS_8[k][c]), abs=1e-12)


def test_pass_at_k_refuses_k_over_n_and_bad_c():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError):
        pass_at_k(8, 9, 1)


def test_mean_at_k_uses_the_first_k():
    correct = [True, False, True, True, False, False, False, False]
    assert mean_at_k(correct, 1) == 1.0
    assert mean_at_k(correct, 4) == 0.75
    assert mean_at_k(correct, 8) == 3 / 8
    with pytest.raises(ValueError, match="at least 9"):
        mean_at_k(correct, 9)


def test_majority_plain_and_no_answer():
    assert majority_index(["3", "4", "4", None, "3", "4"]) == 1  # "4" thrice
    assert majority_index([None, None]) is None
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_majority_tie_goes_to_the_answer_first_at_the_top_count():
    # "a" and "b" both twice; "b" reached 2 first (sample 2), "a" only at sample 3.
    answers = ["a", "b", "b", "a"]
    assert majority_index(answers) == 1
    assert maj_at_k(answers, [True, False, False, True], 4) == 0.0
    # a one-each tie: the first sample's answer
    assert majority_index(["x", "y", "z"]) == 0
    assert maj_at_k(["x", "y", "z"], [False, True, True], 3) == 0.0


def test_maj_at_k_looks_at_the_first_k_only():
    answers = ["1", "2", "2", "2", "1"]
    correct = [True, False, False, False, True]
    assert maj_at_k(answers, correct, 1) == 1.0  # only "1" voted
    assert maj_at_k(answers, correct, 5) == 0.0  # "2" wins 3 to 2


def test_parse_metric_and_dispatch():
    assert parse_metric("pass@8") == ("pass", 8)
    assert parse_metric("greedy") == ("greedy", 1)
    for bad in ("pass@0", "best@4", "mean8", "maj@-1"):
        with pytest.raises(ValueError):
            parse_metric(bad)
    correct, answers = [True, False, False, False], ["5", "6", "6", None]
    assert problem_metric("mean", 4, correct, answers) == 0.25
    assert problem_metric("pass", 2, correct, answers) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert problem_metric("maj", 4, correct, answers) == 0.0
