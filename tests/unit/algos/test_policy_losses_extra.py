"""GMPO, DPPO, DRO, KL-Cov and Clip-Cov: hand-computed cases, masked tokens, fully masked
rows, and the token selectors (CPU). Gradient paths and micro-batch invariance of every
registered loss are checked in test_policy_losses.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import POLICY_LOSSES, Aggregation
from rlpost.params import LossChoice, variants
from tests.unit.algos.losscall import policy_loss

TOKEN_MEAN = Aggregation("token-mean")
SEQ_MEAN = Aggregation("seq-mean-token-mean")


def leaf(values):
    return torch.tensor(values, dtype=torch.float32).requires_grad_(True)


def test_gmpo_hand_computed_sign_aware_log_clip():
    # row 0 (A = 1): log-ratios 0.1, 0.6 (clipped to 0.4), -0.5 (kept: clip only caps gains)
    # row 1 (A = -1): same log-ratios: 0.1, 0.6 kept, -0.5 clipped to -0.4
    # row 2: fully masked with junk; column 3 is a masked junk token in every row
    old = torch.full((3, 4), -1.0)
    d = torch.tensor([[0.1, 0.6, -0.5, 9.0], [0.1, 0.6, -0.5, 9.0], [5.0, 5.0, 5.0, 5.0]])
    lp = (old + d).requires_grad_(True)
    adv = torch.tensor([[1.0] * 3 + [50.0], [-1.0] * 3 + [50.0], [7.0] * 4])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 1, 1, 0], [0.0] * 4])
    out = policy_loss("gmpo")(lp, old, adv, mask, agg=SEQ_MEAN)
    rho0, rho1 = math.exp(0.0), math.exp((0.1 + 0.6 - 0.4) / 3)
    assert out.loss.item() == pytest.approx((-rho0 + rho1) / 2, rel=1e-5)
    assert out.stats["clip_frac"].item() == pytest.approx(2 / 6)
    out.loss.backward()
    # d(-A rho)/d lp_t = -A rho / n on unclipped tokens, averaged over the 2 rows
    want = torch.tensor(
        [[-rho0 / 6, 0.0, -rho0 / 6, 0.0], [rho1 / 6, rho1 / 6, 0.0, 0.0], [0.0] * 4]
    )
    torch.testing.assert_close(lp.grad, want)


def dppo_tokens():
    # q = 0.5 everywhere; p moves up (0.8) or down (0.2); A = +1, +1, -1, -1; token 4 masked
    old = torch.log(torch.full((1, 5), 0.5))
    lp = leaf([[math.log(0.8), math.log(0.2), math.log(0.8), math.log(0.2), 3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return lp, old, adv, mask


@pytest.mark.parametrize(("divergence", "param"), [("tv", {"tr_tv": 0.2}), ("binary_kl", {})])
def test_dppo_drops_tokens_that_moved_past_the_region_in_the_advantage_direction(divergence, param):
    # TV |p - q| = 0.3 > 0.2 and binary KL = 0.223 > 0.05 for every token: only the side
    # the advantage favours is dropped (token 0 went up with A > 0, token 3 down with A < 0)
    lp, old, adv, mask = dppo_tokens()
    out = policy_loss("dppo")(lp, old, adv, mask, agg=TOKEN_MEAN, divergence=divergence, **param)
    kept = -1.0 * 0.4 * math.log(0.2) + 1.0 * 1.6 * math.log(0.8)
    assert out.loss.item() == pytest.approx(kept / 4, rel=1e-5)
    assert out.stats["clip_frac"].item() == pytest.approx(0.5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.4 / 4, 1.6 / 4, 0.0, 0.0]]))


def test_dppo_inside_the_region_is_ppo_and_caps_the_weight():
    lp, old, adv, mask = dppo_tokens()
    wide = policy_loss("dppo")(lp, old, adv, mask, agg=TOKEN_MEAN, divergence="tv", tr_tv=0.5)
    wide.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.6, -0.4, 1.6, 0.4, 0.0]]) / 4)
    lp2, old2, adv2, mask2 = dppo_tokens()
    capped = policy_loss("dppo")(
        lp2, old2, adv2, mask2, agg=TOKEN_MEAN, divergence="tv", tr_tv=0.5, is_cap=1.0
    )
    capped.loss.backward()
    torch.testing.assert_close(lp2.grad, torch.tensor([[-1.0, -0.4, 1.0, 0.4, 0.0]]) / 4)
    assert capped.stats["is_capped_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="divergence"):
        policy_loss("dppo")(lp, old, adv, mask, agg=TOKEN_MEAN, divergence="js")


def test_dro_hand_computed():
    old = torch.tensor([[-1.0, -2.0, -1.0]])
    lp = leaf([[-1.0 + math.log(1.5), -2.0, 4.0]])
    adv = torch.tensor([[1.0, -0.5, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss("dro")(lp, old, adv, mask, agg=TOKEN_MEAN, reg_coef=2.0)
    d = math.log(1.5)
    assert out.loss.item() == pytest.approx((-(-1.0 + d) + d**2 + 0.5 * -2.0) / 2, rel=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[(-1.0 + 2.0 * d) / 2, 0.5 / 2, 0.0]]))


def cov_tokens():
    # A = (1, 1, -1, -1) -> mean 0; lp = (-0.2, -2, -1, -3) -> mean -1.55
    # covariance A (lp + 1.55) = (1.35, -0.45, -0.55, 1.45); column 4 masked junk
    lp = leaf([[-0.2, -2.0, -1.0, -3.0, 40.0]])
    old = lp.detach() - 0.1
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return lp, old, adv, mask


def test_kl_cov_penalises_the_top_covariance_tokens():
    lp, old, adv, mask = cov_tokens()
    out = policy_loss("kl_cov")(
        lp, old, adv, mask, agg=TOKEN_MEAN, kl_cov_ratio=0.25, ppo_kl_coef=2.0
    )
    r = math.exp(0.1)
    assert out.loss.item() == pytest.approx((-r - r + r + r + 2.0 * 0.1) / 4, rel=1e-5)
    assert out.stats["clip_frac"].item() == pytest.approx(0.25)
    out.loss.backward()
    # the selected token 3 (covariance 1.45) gets the |log-ratio| gradient 2.0 on top
    torch.testing.assert_close(lp.grad, torch.tensor([[-r, -r, r, r + 2.0, 0.0]]) / 4)
    half = policy_loss("kl_cov")(lp, old, adv, mask, agg=TOKEN_MEAN, kl_cov_ratio=0.5)
    assert half.stats["clip_frac"].item() == pytest.approx(0.5)  # tokens 3 and 0


def test_clip_cov_removes_the_gradient_of_band_tokens():
    lp, old, adv, mask = cov_tokens()
    out = policy_loss("clip_cov")(
        lp, old, adv, mask, agg=TOKEN_MEAN, clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=1.4
    )
    # band (1.0, 1.4) holds token 0 only (1.45 is above it); ratio e^0.1 < 1.2: no PPO clip
    r = math.exp(0.1)
    assert out.loss.item() == pytest.approx((-r + r + r) / 4, rel=1e-5)
    assert out.stats["cov_selected_frac"].item() == pytest.approx(0.25)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -r, r, r, 0.0]]) / 4)


def test_selected_from_the_caller_overrides_and_fully_masked_row_is_empty():
    lp, old, adv, mask = cov_tokens()
    chosen = torch.tensor([[False, True, False, False, False]])
    out = policy_loss("kl_cov")(lp, old, adv, mask, agg=TOKEN_MEAN, selected=chosen)
    assert out.stats["clip_frac"].item() == pytest.approx(0.25)
    select = POLICY_LOSSES.trait("kl_cov", "token_selector")
    empty = select(
        lp.detach(), adv, torch.zeros_like(mask), variants(LossChoice)["kl_cov"](kl_cov_ratio=0.5)
    )
    assert not empty.any()
    with pytest.raises(ValueError, match="selected shape"):
        policy_loss("kl_cov")(lp, old, adv, mask, agg=TOKEN_MEAN, selected=chosen[:, :2])


def test_selectors_are_registered_as_traits():
    assert sorted(n for n in POLICY_LOSSES.names() if POLICY_LOSSES.trait(n, "token_selector")) == [
        "clip_cov",
        "kl_cov",
    ]
