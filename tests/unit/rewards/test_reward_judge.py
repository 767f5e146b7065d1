"""Judge helpers without a server: score parsing, rubric filling, argument checks.
The HTTP behaviour is in tests/integration/test_judge.py."""

import pytest

from rlpost.rewards.judge import JudgeScorer, parse_score, render_rubric
from rlpost.types import RewardSample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Score: 7", 7.0),
        ("score=8.5", 8.5),
        ("The response is fine. 3 issues. Score: 9", 9.0),  # marked score wins
        ("Score: 2 ... on reflection, Score: 6", 6.0),  # the last verdict
        ("7/10", 7.0),
        ("-1", -1.0),
        ("excellent!", None),
        ("", None),
    ],
)
def test_parse_score(text, expected):
    assert parse_score(text) == expected


def test_render_rubric_does_not_expand_model_output():
    sample = RewardSample("2+2?", "it is {answer} {x}", answer=4)
    text = render_rubric("Q {prompt} A {completion} R {answer} {literal}", sample)
    assert text == "Q 2+2? A it is {answer} {x} R 4 {literal}"
    # a lone surrogate cannot travel in a request body: it is replaced, not raised on
    assert render_rubric("{completion}", RewardSample("q", "a\ud800b")) == "a?b"


def test_constructor_checks():
    with pytest.raises(ValueError, match="base_url"):
        JudgeScorer("127.0.0.1:9/v1", "m")
    with pytest.raises(ValueError, match="api"):
        JudgeScorer("http://127.0.0.1:9/v1", "m", api="embeddings")
    with pytest.raises(ValueError, match="completion"):
        JudgeScorer("http://127.0.0.1:9/v1", "m", rubric="{prompt}")
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR"):
        JudgeScorer("http://127.0.0.1:9/v1", "m", api_key_env="NO_SUCH_KEY_VAR")


def test_unreachable_judge_gives_default_and_counts():
    judge = JudgeScorer("http://127.0.0.1:9/v1", "m", retries=1, backoff=0.0, timeout=1.0)
    try:
        assert judge.score([RewardSample("q", "c")] * 2) == [0.0, 0.0]
    finally:
        judge.close()
    counts = judge.counters()
    assert counts["failures"] == 2 and counts["failures_connection"] == 2
    assert counts["retries"] == 2 and counts["requests"] == 4
