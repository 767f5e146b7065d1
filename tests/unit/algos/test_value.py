"""Clipped value loss against hand-computed cases (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.algos import Aggregation, value_loss

AGG = Aggregation()


def test_clip_case_hand_computed():
    pred = torch.tensor([[1.0, 0.6, 1.0, 1.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    ret = torch.tensor([[2.0, 0.0, 1.5, 0.5]], requires_grad=True)
    out = value_loss(pred, ret, old, torch.ones(1, 4), agg=AGG, clip_range=0.2)
    # clipped preds 0.7, 0.6, 0.7, 0.7 -> 1/2 max: 1.69, 0.36, 0.64, 0.25 over errors 1, 0.36, 0.25, 0.25
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 0.36 + 0.64 + 0.25) / 4, rel=1e-6)
    assert out.stats["vf_clip_frac"].item() == pytest.approx(0.5)
    out.loss.backward()
    # the clipped branch is saturated: zero gradient where it wins; else (v - R) / N
    torch.testing.assert_close(pred.grad, torch.tensor([[0.0, 0.6 / 4, 0.0, 0.5 / 4]]))
    assert old.grad is None and ret.grad is None


def test_no_clip_is_half_squared_error():
    pred = torch.tensor([[1.0, 3.0]])
    out = value_loss(
        pred, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), agg=AGG, clip_range=None
    )
    assert out.loss.item() == pytest.approx(0.5 * (1 + 9) / 2)
    assert out.stats["vf_clip_frac"].item() == 0.0


def test_explained_variance_and_masking():
    ret = torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    perfect = value_loss(ret.clone(), ret, ret, mask, agg=AGG)
    assert perfect.stats["vf_explained_var"].item() == pytest.approx(1.0, abs=1e-6)
    assert perfect.loss.item() == 0.0
    mean_pred = torch.full_like(ret, 22.0 / 6)
    flat = value_loss(mean_pred, ret, mean_pred, mask, agg=AGG)
    assert flat.stats["vf_explained_var"].item() == pytest.approx(0.0, abs=1e-6)
    junk = mean_pred.clone()
    junk[mask == 0] = 1e6
    torch.testing.assert_close(value_loss(junk, ret, mean_pred, mask, agg=AGG).loss, flat.loss)


def test_bad_input():
    with pytest.raises(ValueError, match="returns shape"):
        value_loss(
            torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2, 3), torch.ones(2, 3), agg=AGG
        )
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            agg=AGG,
            clip_range=0,
        )


def test_no_clip_counted_when_nothing_clips():
    # Random float32 values far inside a wide range: old + (v - old) often differs from v by
    # one rounding step, which must neither count as a clip nor change the loss.
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(8, 64, generator=g) for _ in range(3))
    out = value_loss(v, ret, old, torch.ones(8, 64), agg=AGG, clip_range=100.0)
    assert out.stats["vf_clip_frac"].item() == 0.0
    torch.testing.assert_close(out.loss, 0.5 * ((v - ret) ** 2).mean())
