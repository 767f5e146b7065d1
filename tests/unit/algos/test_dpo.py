"""DPO and IPO losses against hand-computed values (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import dpo_loss


def pair():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    rc = torch.tensor([-1.5], requires_grad=True)
    rr = torch.tensor([-1.5], requires_grad=True)
    return pc, pr, rc, rr  # h = (0.5) - (-0.5) = 1


def test_sigmoid_hand_computed():
    pc, pr, rc, rr = pair()
    out = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.1)), rel=1e-6)
    out.loss.backward()
    sig = 1 / (1 + math.exp(0.1))  # sigmoid(-beta h)
    assert pc.grad.item() == pytest.approx(-0.1 * sig, rel=1e-5)
    assert pr.grad.item() == pytest.approx(0.1 * sig, rel=1e-5)
    assert rc.grad is None and rr.grad is None
    assert out.stats["chosen_reward"].item() == pytest.approx(0.05)
    assert out.stats["rejected_reward"].item() == pytest.approx(-0.05)
    assert out.stats["reward_margin"].item() == pytest.approx(0.1)
    assert out.stats["reward_accuracy"].item() == 1.0


def test_label_smoothing_and_ipo():
    smooth = dpo_loss(*pair(), beta=0.1, label_smoothing=0.1)
    expected = 0.9 * math.log1p(math.exp(-0.1)) + 0.1 * math.log1p(math.exp(0.1))
    assert smooth.loss.item() == pytest.approx(expected, rel=1e-6)
    ipo = dpo_loss(*pair(), beta=0.1, loss_type="ipo")
    assert ipo.loss.item() == pytest.approx((1.0 - 5.0) ** 2)


def test_num_pairs_makes_micro_batches_sum_to_batch():
    gen = torch.Generator().manual_seed(0)
    logps = [torch.randn(6, generator=gen) - 5 for _ in range(4)]
    full = dpo_loss(*logps).loss
    parts = sum(dpo_loss(*(t[i : i + 2] for t in logps), num_pairs=6).loss for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)


def test_bad_input():
    pc, pr, rc, rr = pair()
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'"):
        dpo_loss(pc, pr, rc, rr, loss_type="hinge")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="ref_chosen_logps shape"):
        dpo_loss(pc, pr, torch.zeros(2), rr)
