"""Evaluation sets: the vote's answer extraction and a set's metrics from scored groups."""

from __future__ import annotations

import pytest

from rlpost.config import ArithConfig, EvalSetConfig, RewardTerm
from rlpost.pipeline.eval_sets import set_metrics
from rlpost.rewards.answers import answer_extractor
from rlpost.types import Completion, Group, Prompt


def test_numeric_match_votes_by_number():
    read = answer_extractor([RewardTerm(name="numeric_match")])
    assert read("12") == read(" 12.0") == read("12 apples") == 12.0
    assert read("no number") is None
    last = answer_extractor([RewardTerm(name="numeric_match", position="last")])
    assert last("3 then 4") == 4.0


def test_exact_match_and_reasoning_gym_read_their_tag():
    read = answer_extractor([RewardTerm(name="exact_match", tag="answer")])
    assert read("x <answer> ab </answer>") == "ab"
    assert read("ab") is None  # no tag: no answer, no vote
    rg = answer_extractor([RewardTerm(name="reasoning_gym", extract="whole")])
    assert rg(" 7\n") == "7" and rg("  ") is None
    other = answer_extractor([RewardTerm(name="os.path:basename")])
    assert other(" yes ") == "yes"


def _group(texts: list[str], scores: list[float]) -> Group:
    completions = [
        Completion(prompt_ids=[1], token_ids=[2], logprobs=[0.0], finish_reason="stop",
                   policy_version=0, group=0, text=t)
        for t in texts
    ]  # fmt: skip
    return Group(prompt=Prompt(text="q", answer=5), completions=completions, scores=scores)


def test_set_metrics_match_hand_values():
    s = EvalSetConfig(name="s", task=ArithConfig(), metrics=["mean@2", "pass@2", "maj@4", "greedy"])
    assert s.n == 4
    groups = [
        # correct 1 of 4; vote: "6" twice beats "5" once -> maj 0
        _group(["5", "6", "6", "x"], [1.0, 0.0, 0.0, 0.0]),
        # correct 2 of 4; "5" and "7" tie at 2, "5" reached 2 first -> maj 1
        _group(["7", "5", "5", "7"], [0.0, 1.0, 1.0, 0.0]),
    ]
    got = set_metrics(s, groups, answer_extractor([RewardTerm(name="numeric_match")]), 2)
    assert got["mean@2"] == pytest.approx((0.5 + 0.5) / 2)
    # pass@2 with n=4: 1 - C(3,2)/C(4,2) = 0.5 and 1 - C(2,2)/C(4,2) = 5/6
    assert got["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert got["maj@4"] == pytest.approx(0.5)
    assert got["reward_mean"] == pytest.approx(3 / 8)
    assert "greedy" not in got  # sampled separately, at temperature 0
