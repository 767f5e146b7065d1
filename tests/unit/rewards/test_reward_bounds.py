"""Scoring is bounded in time: numbers too large for exact arithmetic and scorers that overrun
score ``invalid_score``, counted, and return at once (``Fraction("1e999999999")`` alone runs
for hours)."""

from __future__ import annotations

import math
import time

import pytest

from rlpost.rewards.scorer import RewardScorer, Term
from rlpost.rewards.verifiable import numbers_bounded
from rlpost.types import RewardSample

HUGE = "1e999999999"


def test_numbers_past_the_bounds_are_refused_before_exact_arithmetic():
    assert numbers_bounded("12.5e3 and 1E-1000 and -7 and the end")
    for text in (HUGE, "2.5E+1001", "1e-99999", "1_0e1_000_0", "9" * 4301, "x 3.e 1001"):
        assert not numbers_bounded(text), text


def _scored(term: Term, samples: list[RewardSample]):
    scorer = RewardScorer([term], invalid_score=-1.0)
    start = time.monotonic()
    out = scorer.score(samples)
    return out, scorer.counters(), time.monotonic() - start


def test_a_countdown_target_too_large_scores_invalid_and_counted():
    from rlpost.rewards.countdown import countdown

    rows = [{"numbers": [2, 3], "target": HUGE}, {"numbers": [2, 3], "target": 6}]
    samples = [RewardSample("p", "<answer>2*3</answer>", None, m) for m in rows]
    out, counters, took = _scored(Term("countdown", countdown, 1.0, "verifiable"), samples)
    assert out.scores == [-1.0, 1.0] and out.invalid_rows == [0] and took < 5
    assert counters["countdown/invalid"] == 1


rg = pytest.importorskip("reasoning_gym")


def _coin_flip(answer: str) -> RewardSample:
    from rlpost.data.reasoning_gym import TaskEntry

    entry = rg.create_dataset("coin_flip", seed=0, size=1)[0]
    meta = {"reasoning_gym": TaskEntry("coin_flip", {}, entry)}
    return RewardSample("q", f"<answer>{answer}</answer>", entry["answer"], meta)


def test_a_reasoning_gym_answer_too_large_scores_invalid_and_counted():
    from rlpost.rewards.reasoning_gym import ReasoningGymScorer

    rgs = ReasoningGymScorer()
    gold = _coin_flip(_coin_flip("").answer)
    out, counters, took = _scored(
        Term("rg", None, 1.0, "verifiable", scorer=rgs), [_coin_flip(HUGE), gold]
    )
    rgs.close()
    assert out.scores == [-1.0, 1.0] and out.invalid_rows == [0] and took < 30
    assert counters["rg/invalid"] == 1 and counters["rg/too_large"] == 1


def test_the_helper_stops_a_call_past_its_deadline_and_starts_afresh():
    from rlpost.rewards.helper import Helper, Overran

    helper = Helper()
    assert helper.call(math.factorial, 5, timeout_s=5) == 120
    start = time.monotonic()
    with pytest.raises(Overran, match=r"sleep overran 0\.5 s"):
        helper.call(time.sleep, 60, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert helper.call(math.factorial, 4, timeout_s=5) == 24
    helper.close()
