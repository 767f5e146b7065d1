"""KL coefficient controllers (CPU)."""

from __future__ import annotations

import pytest

from rlpost.algos import AdaptiveKLController, FixedKLController


def test_fixed_never_moves():
    ctl = FixedKLController(0.05)
    assert ctl.update(10.0, 64) == 0.05
    assert ctl.state_dict() == {"beta": 0.05}


def test_adaptive_moves_toward_target():
    high = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    assert high.update(0.022, n_steps=100) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    low = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    assert low.update(0.017, n_steps=100) == pytest.approx(0.1 * (1 - 0.15 * 0.1))


def test_adaptive_error_is_clipped():
    ctl = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    assert ctl.update(2.0, n_steps=500) == pytest.approx(0.1 * 1.1)
    assert ctl.update(0.0, n_steps=500) == pytest.approx(0.1 * 1.1 * 0.9)


def test_state_round_trip():
    ctl = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    ctl.update(0.05, n_steps=256)
    resumed = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.beta == ctl.beta != 0.1
    fixed = FixedKLController(0.1)
    fixed.load_state_dict({"beta": 0.3})
    assert fixed.update(0.0, 1) == 0.3


def test_validation():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="beta"):
        FixedKLController(-1.0)
