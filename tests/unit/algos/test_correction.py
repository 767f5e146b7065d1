"""Rollout corrections against hand-computed weights (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.correction import CORRECTIONS, get_correction
from rlpost.config import load_config
from rlpost.registry import UnknownNameError

# proximal / behaviour ratios per token: 1.5, 0.25, 8.0, 1.0 (last row: padding)
RATIOS = torch.tensor([[1.5, 0.25, 8.0, 1.0], [1.2, 0.9, 1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
ROLLOUT = torch.full((2, 4), -1.0)
PROX = ROLLOUT + RATIOS.log()


def variant(name, **kw):
    """The config's variant of ``name`` with ``kw`` set (its defaults otherwise)."""
    over = [
        f"algo.rollout_correction.name={name}",
        *(f"algo.rollout_correction.{k}={v}" for k, v in kw.items()),
    ]
    return load_config(None, over).algo.rollout_correction


def run(name, **kw):
    return get_correction(name)(PROX, ROLLOUT, MASK, variant(name, **kw))


def test_token_tis_truncates_at_the_cap():
    out = run("tis", cap=2.0)
    want = torch.tensor([[1.5, 0.25, 2.0, 1.0], [1.2, 0.9, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, want)
    assert out.stats["is_weight_mean"].item() == pytest.approx((1.5 + 0.25 + 2 + 1 + 1.2 + 0.9) / 6)
    assert out.stats["is_masked_frac"].item() == 0.0


def test_sequence_tis_uses_the_product_of_ratios():
    out = run("seq_tis", cap=10.0)
    row0, row1 = min(1.5 * 0.25 * 8.0 * 1.0, 10.0), 1.2 * 0.9
    want = torch.tensor([[row0] * 4, [row1, row1, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, want)


def test_token_mask_drops_tokens_outside_the_band():
    out = run("mask", low=0.5, high=5.0)
    want = torch.tensor([[1.5, 0.0, 0.0, 1.0], [1.2, 0.9, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, want)
    assert out.stats["is_masked_frac"].item() == pytest.approx(2 / 6)


def test_sequence_mask_drops_whole_rows():
    out = run("seq_mask", low=0.5, high=5.0, cap=2.0)
    want = torch.tensor([[0.0] * 4, [1.2, 0.9, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, want)
    assert out.stats["is_masked_frac"].item() == pytest.approx(4 / 6)


def test_effective_sample_size_is_one_for_equal_weights():
    same = get_correction("tis")(ROLLOUT, ROLLOUT, MASK, variant("tis"))
    assert same.stats["is_ess"].item() == pytest.approx(1.0)
    skewed = run("tis", cap=100.0).stats["is_ess"].item()
    w = [1.5, 0.25, 8.0, 1.0, 1.2, 0.9]
    assert skewed == pytest.approx(sum(w) ** 2 / (6 * sum(x * x for x in w)), rel=1e-5)


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_weights_are_detached_nonnegative_and_zero_on_padding(name):
    prox = PROX.clone().requires_grad_(True)
    out = get_correction(name)(prox, ROLLOUT, MASK, variant(name))
    assert not out.weights.requires_grad
    assert (out.weights >= 0).all() and torch.equal(out.weights * (1 - MASK), torch.zeros(2, 4))
    assert all(math.isfinite(float(v)) for v in out.stats.values())


def test_bad_input():
    with pytest.raises(UnknownNameError, match="valid: mask"):
        get_correction("icepop")
    with pytest.raises(ValueError, match=r"algo\.rollout_correction\.high=0\.9: must be > 1"):
        run("mask", low=0.5, high=0.9)
    with pytest.raises(ValueError, match="shapes differ"):
        get_correction("tis")(PROX, ROLLOUT[:, :2], MASK, variant("tis"))
