"""DAPO overlong penalty and dynamic-sampling filter (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.algos import group_zero_spread_fraction, groups_with_spread, overlong_penalty


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 16, 18, 20, 21, 500])
    out = overlong_penalty(lengths, max_len=20, cache_len=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0, -1.0]))
    scaled = overlong_penalty(lengths, max_len=20, cache_len=4, factor=2.0)
    torch.testing.assert_close(scaled, 2.0 * out)
    cliff = overlong_penalty(lengths, max_len=20, cache_len=0)
    torch.testing.assert_close(cliff, torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(lengths, max_len=20, cache_len=30)


def test_dynamic_sampling_filter():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    group = torch.tensor([5, 5, 9, 9, 2, 2, 7])
    keep = groups_with_spread(scores, group)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    # groups 5, 2 and singleton 7 have no spread; group 9 has
    assert group_zero_spread_fraction(scores, group) == pytest.approx(3 / 4)


def test_order_free_and_empty():
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0])
    group = torch.tensor([3, 8, 3, 8])
    assert groups_with_spread(scores, group).tolist() == [True, False, True, False]
    empty = torch.zeros(0)
    assert group_zero_spread_fraction(empty, torch.zeros(0, dtype=torch.long)) == 0.0
    with pytest.raises(ValueError, match="must both be"):
        groups_with_spread(scores, group[:3])
