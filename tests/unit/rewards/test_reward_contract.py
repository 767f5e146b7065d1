"""Contract: every registered reward takes any canonical sample and returns a finite
float or None, deterministically. A new reward is covered the day it is registered."""

import math

import pytest

from rlpost.rewards.catalog import get_reward
from rlpost.rewards.registry import REWARDS, SCORERS
from rlpost.types import RewardSample

CANONICAL = RewardSample(
    prompt="Using 3, 5 and 7 once each, make 22.",
    completion="<think>3 * 5 = 15, 15 + 7 = 22</think>\n<answer>3 * 5 + 7</answer>",
    answer="22",
    metadata={"numbers": [3, 5, 7], "target": 22, "tests": ["assert 3 * 5 + 7 == 22"]},
    finish_reason="stop",
    num_tokens=24,
    max_tokens=64,
)
BARE = RewardSample(prompt="", completion="")
HOSTILE = RewardSample(
    prompt="q",
    completion="{answer} \\boxed{" + "(" * 500 + "\x00 ```python\n" + "ab " * 2000,
    answer="1e999",
    metadata={"numbers": [1], "target": 1},
    finish_reason="length",
    num_tokens=5000,
    max_tokens=4096,
)


def _call(name: str, sample: RewardSample):
    try:
        return get_reward(name)(sample)
    except Exception as exc:  # only a missing sandbox may excuse a reward here
        missing = type(exc).__name__ == "SandboxUnavailable" or isinstance(exc, ImportError)
        if name == "code_tests" and missing:
            pytest.skip(f"{name}: sandbox not available ({exc})")
        raise


@pytest.mark.parametrize("name", REWARDS.names())
@pytest.mark.parametrize("sample", [CANONICAL, BARE, HOSTILE], ids=["canonical", "bare", "hostile"])
def test_reward_returns_finite_float_or_none(name, sample):
    value = _call(name, sample)
    assert value is None or (isinstance(value, float) and math.isfinite(value)), value
    assert _call(name, sample) == value


def test_registry_is_not_empty_and_names_are_disjoint():
    expected = {"numeric_match", "exact_match", "math_verify", "countdown", "code_tests"}
    assert expected | {"format", "overlong_penalty", "length", "repetition"} <= set(REWARDS.names())
    assert {"judge", "reward_model"} <= set(SCORERS.names())
    assert not set(REWARDS.names()) & set(SCORERS.names())


def test_canonical_sample_is_correct_for_countdown_and_format():
    for name in ("countdown", "format"):
        assert get_reward(name)(CANONICAL) == 1.0, name
