"""KL estimators: hand values, verl clamps, straight-through gradients (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import KL_ESTIMATORS, get_kl_estimator, kl_penalized_rewards
from rlpost.registry import UnknownNameError

X = [0.5, -0.5, -30.0, 30.0]


def evaluate(name, xs=X):
    ref = torch.full((1, len(xs)), -2.0)
    lp = (ref + torch.tensor([xs])).requires_grad_(True)
    out = get_kl_estimator(name)(lp, ref)
    out.sum().backward()
    return out.detach()[0].tolist(), lp.grad[0].tolist()


def k3_hand(x):
    y = min(max(-x, -20.0), 20.0)
    return min(max(math.exp(y) - y - 1.0, -10.0), 10.0)


def test_hand_values():
    k1, _ = evaluate("k1")
    k2, _ = evaluate("k2")
    k3, _ = evaluate("k3")
    ab, _ = evaluate("abs")
    assert k1 == pytest.approx(X)
    assert k2 == pytest.approx([0.125, 0.125, 450.0, 450.0])  # verl leaves k1/k2 unclamped
    assert k3[:2] == pytest.approx([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5], rel=1e-6)
    assert k3 == pytest.approx([k3_hand(x) for x in X], rel=1e-6)
    assert k3[2:] == [10.0, 10.0]
    assert ab == pytest.approx([abs(x) for x in X])


def test_gradients():
    _, g1 = evaluate("k1")
    _, g3 = evaluate("k3")
    assert g1 == pytest.approx([1.0] * 4)
    # d/dx (e^{-x} + x - 1) = 1 - e^{-x}; zero where a clamp is active
    assert g3 == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0, 0.0], rel=1e-5)


@pytest.mark.parametrize("name", ["k1+", "k3+", "abs+"])
def test_straight_through_value_of_base_gradient_of_half_square(name):
    values, grads = evaluate(name)
    base, _ = evaluate(name[:-1])
    assert values == pytest.approx(base)
    assert grads == pytest.approx(X)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_reference_gets_no_gradient(name):
    ref = torch.full((2, 3), -1.0, requires_grad=True)
    lp = torch.full((2, 3), -0.7, requires_grad=True)
    get_kl_estimator(name)(lp, ref).sum().backward()
    assert ref.grad is None and lp.grad is not None


def test_kl_penalized_rewards():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, 9.0], [-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -0.5, -9.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, mean_kl = kl_penalized_rewards(scores, old, ref, mask, beta=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.05, 0.0], [0.0, 0.1, 0.2]]))
    assert mean_kl.item() == pytest.approx((0.0 + -1.0) / 2)  # mean of per-row means


def test_errors():
    with pytest.raises(UnknownNameError, match=r"valid: abs, abs\+, k1"):
        get_kl_estimator("low_var_kl")
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        get_kl_estimator("k1")(torch.zeros(2, 3), torch.zeros(2, 2))
