"""Reward functions loaded by ``package.module:function`` in tests."""

import math


def nan_reward(sample, **_):
    """NaN for every other sample, to check that NaN rewards never reach the optimizer."""
    return math.nan if len(sample.completion) % 2 else 1.0
