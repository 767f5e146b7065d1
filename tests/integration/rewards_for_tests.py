"""Reward functions loaded by ``package.module:function`` in tests."""

import math


def nan_reward(sample, **_):
    """NaN for every other sample, to check that NaN rewards never reach the optimizer."""
    return math.nan if len(sample.completion) % 2 else 1.0


def length_reward(sample, **_):
    """Longer completions score more (up to 4 characters): spread within every group."""
    return min(len(sample.completion), 4) / 4
