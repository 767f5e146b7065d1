"""Rule rewards: format regex, DAPO overlong penalty, length window, repetition."""

import pytest

from rlpost.rewards.rule import format_reward, length_reward, overlong_penalty, repetition_penalty
from rlpost.types import RewardSample


def sample(completion: str = "", num_tokens: int = 0, max_tokens: int = 0) -> RewardSample:
    return RewardSample("q", completion, num_tokens=num_tokens, max_tokens=max_tokens)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>a\nb</think>\n<answer>4</answer>", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<think>a</think><answer>4</answer>\n", 1.0),  # $ allows one final newline
        ("<answer>4</answer>", 0.0),
        ("<think>a</think><answer>4</answer> trailing", 0.0),
        ("preamble <think>a</think><answer>4</answer>", 0.0),
        ("", 0.0),
    ],
)
def test_default_format(text, expected):
    assert format_reward(sample(text)) == expected


def test_custom_format_and_bad_regex():
    assert format_reward(sample("ANSWER: 4"), pattern=r"^answer: \d+$", ignore_case=True) == 1.0
    assert format_reward(sample("a\nb"), pattern=r"^a.b$", dotall=False) == 0.0
    with pytest.raises(ValueError, match="invalid regex"):
        format_reward(sample("x"), pattern="(")


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (101, -1.0)],
)
def test_overlong_penalty_boundaries(num_tokens, expected):
    # L_max = 100, L_cache = 20: free up to 80, linear to -1 at 100 (DAPO eq. 13).
    s = sample(num_tokens=num_tokens, max_tokens=100)
    assert overlong_penalty(s, cache_len=20) == pytest.approx(expected)


def test_overlong_penalty_defaults_and_errors():
    assert overlong_penalty(sample(num_tokens=90)) is None  # no budget known
    assert overlong_penalty(sample(num_tokens=90), max_tokens=100) == pytest.approx(-0.5)
    params_win = sample(num_tokens=90, max_tokens=1000)
    assert overlong_penalty(params_win, max_tokens=100, cache_len=20) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(sample(num_tokens=5, max_tokens=10), cache_len=11)


def test_length_window():
    assert length_reward(sample(num_tokens=50), min_tokens=10, max_tokens=100) == 0.0
    assert length_reward(sample(num_tokens=5), min_tokens=10) == -1.0
    assert length_reward(sample(num_tokens=105), max_tokens=100, tolerance=10) == -0.5
    assert length_reward(sample(num_tokens=150), max_tokens=100, tolerance=10) == -1.0
    assert length_reward(sample(num_tokens=150, max_tokens=100)) == -1.0
    assert length_reward(sample(num_tokens=150)) is None
    with pytest.raises(ValueError, match="tolerance"):
        length_reward(sample(num_tokens=1), min_tokens=2, tolerance=0)


def test_repetition():
    assert repetition_penalty(sample("a b c d e f")) == 0.0
    assert repetition_penalty(sample("")) == 0.0
    assert repetition_penalty(sample("a b")) == 0.0  # fewer words than n
    # "a b a b a b" has 4 trigrams, 2 distinct: -(4 - 2) / 4
    assert repetition_penalty(sample("a b a b a b")) == pytest.approx(-0.5)
    looped = repetition_penalty(sample("go " * 200))
    assert -1.0 < looped < -0.98
    assert repetition_penalty(sample("abab"), n=2, unit="char") == pytest.approx(-1 / 3)
    with pytest.raises(ValueError, match="unit"):
        repetition_penalty(sample("a"), unit="line")
