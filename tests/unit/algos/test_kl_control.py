"""The KL coefficient: placement, the adaptive controller, guards' raises, state (CPU)."""

from __future__ import annotations

import pytest

from rlpost.algos import KLCoefficient


def test_fixed_never_moves():
    kl = KLCoefficient(0.05)
    assert kl.observe(10.0, 64) == 0.05
    assert kl.state_dict() == {"beta": 0.05}


def test_placement_is_decided_once():
    in_loss, in_reward = KLCoefficient(0.05), KLCoefficient(0.05, "reward")
    assert (in_loss.in_loss, in_loss.in_reward) == (0.05, 0.0)
    assert (in_reward.in_loss, in_reward.in_reward) == (0.0, 0.05)


def test_adaptive_moves_toward_target():
    high = KLCoefficient(0.1, target=0.02, horizon=1000)
    assert high.observe(0.022, n_steps=100) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    low = KLCoefficient(0.1, target=0.02, horizon=1000)
    assert low.observe(0.017, n_steps=100) == pytest.approx(0.1 * (1 - 0.15 * 0.1))


def test_adaptive_error_is_clipped():
    kl = KLCoefficient(0.1, target=0.02, horizon=1000)
    assert kl.observe(2.0, n_steps=500) == pytest.approx(0.1 * 1.1)
    assert kl.observe(0.0, n_steps=500) == pytest.approx(0.1 * 1.1 * 0.9)


def test_a_guard_raises_beta_through_its_owner():
    kl = KLCoefficient(0.1, "reward")
    assert kl.raise_by(2.0) == pytest.approx(0.2) and kl.in_reward == pytest.approx(0.2)
    assert KLCoefficient(0.0).raise_by(2.0) == 0.01  # nothing to multiply
    with pytest.raises(AttributeError):
        kl.beta = 1.0  # read-only: the owner's methods are the only writers


def test_state_round_trip():
    kl = KLCoefficient(0.1, target=0.02, horizon=1000)
    kl.observe(0.05, n_steps=256)
    resumed = KLCoefficient(0.1, target=0.02, horizon=1000)
    resumed.load_state_dict(kl.state_dict())
    assert resumed.beta == kl.beta != 0.1
    fixed = KLCoefficient(0.1)
    fixed.load_state_dict({"beta": 0.3})
    assert fixed.observe(0.0, 1) == 0.3


def test_validation():
    with pytest.raises(ValueError, match="target"):
        KLCoefficient(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        KLCoefficient(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="beta"):
        KLCoefficient(-1.0)
