"""Reward functions loaded by ``package.module:function`` in tests."""

import math


def nan_reward(sample, **_):
    """NaN for every other sampled completion, to check that NaN rewards never reach the
    optimizer (the data's own answers score 1: the load-time check calls it on them)."""
    if sample.completion == str(sample.answer):
        return 1.0
    return math.nan if len(sample.completion) % 2 else 1.0


def length_reward(sample, **_):
    """Longer completions score more (up to 4 characters): spread within every group."""
    return min(len(sample.completion), 4) / 4
