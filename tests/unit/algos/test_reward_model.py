"""Bradley-Terry reward-model loss against hand-computed values (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.reward_model import bradley_terry_loss


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_hand_computed_loss_and_gradient():
    rc = torch.tensor([1.0, 0.5], requires_grad=True)
    rr = torch.tensor([-1.0, 0.5], requires_grad=True)
    out = bradley_terry_loss(rc, rr)
    # -log sigmoid(d) = softplus(-d): d = 2 and d = 0, averaged over two pairs
    assert out.loss.item() == pytest.approx((softplus(-2.0) + math.log(2.0)) / 2, rel=1e-6)
    out.loss.backward()
    # d/dr_c = -sigmoid(-d) / B, d/dr_r = +sigmoid(-d) / B
    s = [1 / (1 + math.exp(2.0)), 0.5]
    assert rc.grad.tolist() == pytest.approx([-s[0] / 2, -s[1] / 2], rel=1e-5)
    assert rr.grad.tolist() == pytest.approx([s[0] / 2, s[1] / 2], rel=1e-5)
    assert out.stats["accuracy"].item() == pytest.approx(0.75)  # one win, one tie
    assert out.stats["reward_margin"].item() == pytest.approx(1.0)
    assert out.stats["chosen_reward"].item() == pytest.approx(0.75)
    assert out.stats["rejected_reward"].item() == pytest.approx(-0.25)


def test_margin_shifts_the_difference():
    rc, rr = torch.tensor([1.0]), torch.tensor([0.0])
    out = bradley_terry_loss(rc, rr, margin=torch.tensor([3.0]))
    assert out.loss.item() == pytest.approx(softplus(2.0), rel=1e-6)  # -log sigmoid(1 - 3)
    assert out.stats["accuracy"].item() == 1.0  # accuracy reads the rewards, not the margin
    plain = bradley_terry_loss(rc, rr, margin=torch.zeros(1))
    assert plain.loss.item() == pytest.approx(bradley_terry_loss(rc, rr).loss.item())


def test_micro_batches_sum_to_the_whole():
    torch.manual_seed(0)
    rc, rr, m = torch.randn(6), torch.randn(6), torch.rand(6)
    whole = bradley_terry_loss(rc, rr, margin=m).loss
    parts = sum(
        bradley_terry_loss(rc[i : i + 2], rr[i : i + 2], margin=m[i : i + 2], num_pairs=6).loss
        for i in range(0, 6, 2)
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_loop_matches_vectorised():
    torch.manual_seed(1)
    rc, rr = torch.randn(5), torch.randn(5)
    pairs = zip(rc.tolist(), rr.tolist(), strict=True)
    loop = sum(-math.log(1 / (1 + math.exp(-(a - b)))) for a, b in pairs)
    assert bradley_terry_loss(rc, rr).loss.item() == pytest.approx(loop / 5, rel=1e-5)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="rejected_rewards shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="margin shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(2), margin=torch.zeros(1))
