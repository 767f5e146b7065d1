"""The extra objectives against verl 0.9.1's formulas, re-derived here (CPU).

Each ``verl_*`` function below restates the formula of verl's
``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_geo_mean``, ``_dppo_kl``,
``_dppo_tv``, ``_dro``, ``_kl_cov``, ``_clip_cov``, ``compute_optimal_token_baseline_advantage``)
in plain torch, and the rlpost loss must give the same value, gradient and metric to 1e-5
on random batches with holes inside the masks, a fully masked row, and log-ratios beyond
+-20. Where rlpost keeps its own rule (docs/algorithms.md, "Where we differ from verl"), a
hand-computed case pins it and shows the input on which the two differ.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import Aggregation, get_advantage_estimator
from tests.unit.algos.losscall import policy_loss

TOKEN_MEAN = Aggregation("token-mean")
SEQ_MEAN = Aggregation("seq-mean-token-mean")
TOL = {"rtol": 1e-5, "atol": 1e-5}


def vmean(x, m):
    """verl's masked_mean: the count gets 1e-8."""
    return (x * m).sum() / (m.sum() + 1e-8)


def random_case(seed, rows=8, width=9):
    """Holes inside masks, one empty and one full row, ~15 % of tokens with |lp - old| > 20."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=gen) < 0.7).float()
    mask[0], mask[1] = 0.0, 1.0
    old = -torch.rand(rows, width, generator=gen) * 3.0
    lp = torch.clamp(old + torch.randn(rows, width, generator=gen) * 0.4, max=-1e-3)
    far = torch.rand(rows, width, generator=gen)
    up, down = far < 0.08, (far >= 0.08) & (far < 0.15)
    lp = torch.where(up, -torch.rand(rows, width, generator=gen) * 0.5, lp)
    old = torch.where(up, -22.0 - torch.rand(rows, width, generator=gen) * 8.0, old)
    lp = torch.where(down, -24.0 - torch.rand(rows, width, generator=gen) * 4.0, lp)
    old = torch.where(down, -torch.rand(rows, width, generator=gen) * 0.3, old)
    adv = torch.randn(rows, width, generator=gen)
    return lp, old, adv, mask


def grad_of(loss, lp):
    (grad,) = torch.autograd.grad(loss, lp)
    return grad


def ours(name, lp, old, adv, mask, agg=TOKEN_MEAN, **params):
    lp = lp.clone().requires_grad_(True)
    out = policy_loss(name)(lp, old, adv, mask, agg=agg, **params)
    return out, grad_of(out.loss, lp)


def theirs(fn, lp, old, adv, mask, **params):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = fn(lp, old, adv, mask, **params)
    return loss, grad_of(loss, lp), metrics


def verl_geo_mean(lp, old, adv, m, low, high):
    d = lp - old
    sgn = torch.sign(adv)
    kept = sgn * torch.min(sgn * d, sgn * torch.clamp(d, -low, high))
    n = m.sum(-1)
    ratio = torch.exp((kept * m).sum(-1) / (n + 1e-8))
    row_adv = (adv * m).sum(-1) / (n + 1e-8)
    return torch.mean(-row_adv * ratio), {"ppo_kl": vmean(-d, m)}


def verl_dppo(lp, old, adv, m, kind, threshold, cap):
    d = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(d)
    p, q = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        valid = torch.where(adv > 0, p - q <= threshold, p - q >= -threshold)
    else:
        bkl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        valid = torch.where(adv > 0, (bkl <= threshold) | (p <= q), (bkl <= threshold) | (p >= q))
    valid = valid.float()
    losses = -adv * torch.clamp(ratio, max=cap).detach() * lp * valid
    return (losses * m).sum() / m.sum(), {
        "pg_clipfrac": vmean(1 - valid, m),
        "ppo_kl": vmean(-d, m),
    }


def verl_dro(lp, old, adv, m, beta):
    d = lp - old
    losses = -(lp * adv - 0.5 * beta * d.square())
    return (losses * m).sum() / m.sum(), {"ppo_kl": vmean(-d, m)}


def verl_kl_cov(lp, old, adv, m, ratio_k, coef):
    d = lp - old
    losses = -adv * torch.exp(d)
    with_kl = losses + coef * d.abs()
    valid = m.flatten() > 0
    idx = torch.nonzero(valid).flatten()
    a, l_ = adv.flatten()[valid], lp.detach().flatten()[valid]
    cov = (a - a.mean()) * (l_ - l_.mean())
    top = idx[torch.topk(cov, max(1, int(len(cov) * ratio_k))).indices]
    pick = torch.zeros(m.numel(), dtype=torch.bool)
    pick[top] = True
    losses = torch.where(pick.view_as(m), with_kl, losses)
    return (losses * m).sum() / m.sum(), {"ppo_kl": vmean(d.abs(), m)}


def verl_clip_cov_all(lp, old, adv, m, low, high, lb, ub):
    """verl's clip_cov with clip_cov_ratio = 1: every candidate is taken (no randomness)."""
    d = lp - old
    ratio = torch.exp(d)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = (l2 > l1) & (m > 0)
    cov = (adv - vmean(adv, m)) * (lp - vmean(lp.detach(), m))
    cov = torch.where((m == 0) | clipped, -torch.inf, cov)
    picked = (cov < ub) & (cov > lb) & (m > 0)
    losses = torch.maximum(l1, l2) * (~picked).float()
    metrics = {"pg_clipfrac": vmean(picked.float(), m), "ppo_kl": vmean(-d, m), "picked": picked}
    return (losses * m).sum() / m.sum(), metrics


def verl_optimal_token_baseline(rewards, m, group, old, spsq, eps=1e-8):
    returns = (rewards * m).flip(-1).cumsum(-1).flip(-1)
    w_cum = ((1 - 2 * torch.exp(old) + spsq) * m).cumsum(-1)
    baselines = torch.zeros_like(returns)
    for g in group.unique():
        rows = torch.nonzero(group == g).flatten()
        if len(rows) == 1:
            continue
        num = (returns[rows] * w_cum[rows] * m[rows]).sum(0)
        den = (w_cum[rows] * m[rows]).sum(0) + eps
        baselines[rows] = (num / den).expand(len(rows), -1)
        lengths = m[rows].sum(-1)
        ordered = torch.sort(lengths).values
        longest, second = int(ordered[-1]), int(ordered[-2])
        where = torch.nonzero(lengths == longest).flatten()
        if where.numel() == 1 and longest > second:
            baselines[rows[where[0]], second:] = 0.0
    return (returns - baselines) * m, returns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmpo_matches_verl_geo_mean_with_every_row_counted(seed):
    lp, old, adv, mask = random_case(seed)
    # verl averages over all B rows; num_seqs = B gives exactly that denominator
    agg = Aggregation("seq-mean-token-mean", num_seqs=mask.shape[0])
    out, grad = ours("gmpo", lp, old, adv, mask, agg=agg, clip_low=0.4, clip_high=0.3)
    loss, want_grad, metrics = theirs(verl_geo_mean, lp, old, adv, mask, low=0.4, high=0.3)
    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(grad * mask, want_grad * mask, **TOL)
    torch.testing.assert_close(out.stats["approx_kl"], metrics["ppo_kl"], **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("divergence", "key", "threshold"), [("binary_kl", "tr_kl", 0.05), ("tv", "tr_tv", 0.2)]
)
def test_dppo_matches_verl_including_the_clamped_kl_metric(seed, divergence, key, threshold):
    lp, old, adv, mask = random_case(seed)
    params = {"divergence": divergence, key: threshold, "is_cap": 3.0}
    out, grad = ours("dppo", lp, old, adv, mask, **params)
    loss, want_grad, metrics = theirs(
        verl_dppo, lp, old, adv, mask, kind=divergence, threshold=threshold, cap=3.0
    )
    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(grad * mask, want_grad * mask, **TOL)
    torch.testing.assert_close(out.stats["clip_frac"], metrics["pg_clipfrac"], **TOL)
    torch.testing.assert_close(out.stats["approx_kl"], metrics["ppo_kl"], **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dro_matches_verl_without_a_clamp(seed):
    lp, old, adv, mask = random_case(seed)
    out, grad = ours("dro", lp, old, adv, mask, reg_coef=0.7)
    loss, want_grad, metrics = theirs(verl_dro, lp, old, adv, mask, beta=0.7)
    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(grad * mask, want_grad * mask, **TOL)
    torch.testing.assert_close(out.stats["approx_kl"], metrics["ppo_kl"], **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_cov_matches_verl_and_abs_kl_is_its_ppo_kl(seed):
    lp, old, adv, mask = random_case(seed)
    out, grad = ours("kl_cov", lp, old, adv, mask, kl_cov_ratio=0.1, ppo_kl_coef=0.5)
    loss, want_grad, metrics = theirs(verl_kl_cov, lp, old, adv, mask, ratio_k=0.1, coef=0.5)
    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(grad * mask, want_grad * mask, **TOL)
    torch.testing.assert_close(out.stats["abs_kl"], metrics["ppo_kl"], **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_verl_on_verls_selection(seed):
    # the selection rule is a documented difference; given verl's tokens, the loss is verl's
    lp, old, adv, mask = random_case(seed)
    band = {"lb": 0.05, "ub": 3.0}
    loss, want_grad, metrics = theirs(
        verl_clip_cov_all, lp, old, adv, mask, low=0.2, high=0.28, **band
    )
    picked = metrics["picked"]
    assert picked.any()
    out, grad = ours("clip_cov", lp, old, adv, mask, selected=picked, clip_low=0.2, clip_high=0.28)
    assert out.loss.abs().item() > 1e6  # the unclamped ratios reach the loss
    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(grad * mask, want_grad * mask, **TOL)
    torch.testing.assert_close(out.stats["approx_kl"], metrics["ppo_kl"], **TOL)
    torch.testing.assert_close(out.stats["cov_selected_frac"], metrics["pg_clipfrac"], **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_token_baseline_matches_verl_when_padding_is_at_the_end(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 10, 7
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[3] = lengths[7] = width  # a group whose two longest rows tie
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(rows, width, generator=gen) * mask
    old = -torch.rand(rows, width, generator=gen) * 3
    spsq = torch.rand(rows, width, generator=gen) * 0.6 + 0.05
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 1, 2, 3])
    adv, ret = get_advantage_estimator("optimal_token_baseline")(
        rewards, mask, group, old_logprobs=old, sum_pi_squared=spsq
    )
    want_adv, want_ret = verl_optimal_token_baseline(rewards, mask, group, old, spsq)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret * mask, want_ret * mask, **TOL)


# ---- rlpost's own rules, pinned by hand -------------------------------------------------


def test_the_clamp_rule_by_hand():
    # one token, lp - old = 25: beyond the +-20 clamp
    old, lp = torch.tensor([[-26.0]]), torch.tensor([[-1.0]])
    adv, mask = torch.tensor([[-1.0]]), torch.tensor([[1.0]])
    ratio = math.exp(25.0)
    # dro, kl_cov, clip_cov and gmpo take the raw log-ratio (verl)
    dro, _ = ours("dro", lp, old, adv, mask, reg_coef=1.0)
    assert dro.loss.item() == pytest.approx(-1.0 + 0.5 * 25.0**2, rel=1e-6)
    kl_cov, _ = ours("kl_cov", lp, old, adv, mask, kl_cov_ratio=1.0, ppo_kl_coef=1.0)
    assert kl_cov.loss.item() == pytest.approx(ratio + 25.0, rel=1e-5)
    clip_cov, _ = ours("clip_cov", lp, old, adv, mask, clip_cov_lb=10.0, clip_cov_ub=20.0)
    assert clip_cov.loss.item() == pytest.approx(ratio, rel=1e-5)  # A < 0: max(-A r, -A 1.2) = r
    gmpo, _ = ours("gmpo", lp, old, adv, mask, agg=SEQ_MEAN)  # A < 0: gains are not clipped
    assert gmpo.loss.item() == pytest.approx(ratio, rel=1e-5)
    # ppo_clip and dppo clamp at 20, and their approx_kl is of the clamped log-ratio (verl)
    for name in ("ppo_clip", "dppo"):
        out, _ = ours(name, lp, old, adv, mask)
        assert out.stats["approx_kl"].item() == pytest.approx(-20.0)
    dppo, _ = ours("dppo", lp, old, adv, mask, divergence="tv", tr_tv=1.0, is_cap=1e12)
    assert dppo.loss.item() == pytest.approx(math.exp(20.0) * -1.0, rel=1e-5)


def test_gmpo_clip_frac_counts_the_tokens_whose_gradient_was_cut():
    # A > 0, log-ratios (0.6, -0.5, 0.1) with range (-0.4, 0.4): the sign-aware clip
    # replaces 0.6 only; -0.5 keeps its gradient. verl's pg_clipfrac counts both (2/3),
    # as tokens outside the range; ours counts the one whose gradient the clip cut (1/3).
    old = torch.full((1, 3), -1.0)
    lp = old + torch.tensor([[0.6, -0.5, 0.1]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    out, grad = ours("gmpo", lp, old, adv, mask, agg=SEQ_MEAN, clip_low=0.4, clip_high=0.4)
    assert out.stats["clip_frac"].item() == pytest.approx(1 / 3)
    rho = math.exp((0.4 - 0.5 + 0.1) / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -rho / 3, -rho / 3]]))
    outside = (lp - old - torch.clamp(lp - old, -0.4, 0.4)) != 0
    assert vmean((outside & (adv > 0)).float(), mask).item() == pytest.approx(2 / 3)


def test_gmpo_counts_only_rows_with_a_valid_token():
    # rows: A = 1 on log-ratios (0, 0) -> -1; A = -2 on (0.2,) -> 2 e^0.2; row 2 empty
    old = torch.full((3, 2), -1.0)
    lp = old + torch.tensor([[0.0, 0.0], [0.2, 0.0], [0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0], [3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    out, _ = ours("gmpo", lp, old, adv, mask, agg=SEQ_MEAN)
    rows = -1.0 + 2.0 * math.exp(0.2)
    assert out.loss.item() == pytest.approx(rows / 2, rel=1e-6)  # ours: 2 non-empty rows
    verl_loss, _ = verl_geo_mean(lp, old, adv, mask, 0.4, 0.4)
    assert verl_loss.item() == pytest.approx(rows / 3, rel=1e-6)  # verl: all 3 rows


def test_kl_cov_reports_the_signed_and_the_absolute_kl():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    lp = old + torch.tensor([[0.5, -0.3, 9.0]])
    adv, mask = torch.tensor([[1.0, -1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    out, _ = ours("kl_cov", lp, old, adv, mask)
    assert out.stats["approx_kl"].item() == pytest.approx((-0.5 + 0.3) / 2)
    assert out.stats["abs_kl"].item() == pytest.approx((0.5 + 0.3) / 2)


def test_optimal_token_baseline_with_a_hole_a_row_alone_has_no_baseline():
    # group of two rows, width 4. row 0 valid at 0,1,2,3; row 1 valid at 0 and 3 (a hole at
    # 1-2, e.g. tool output). w = 1 - 2 pi + spsq = 0.5 everywhere (pi = 0.5, spsq = 0.5).
    # Ours: row 0 is alone at 1 and 2 -> baseline 0 there; at 3 both rows are valid.
    # verl zeroes row 0's baseline from index 2 (= row 1's valid count) on: at 1 it keeps
    # row 0's own return as baseline (A ~ 0), at 3 it drops the shared baseline.
    mask = torch.tensor([[1.0, 1, 1, 1], [1.0, 0, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 1.0], [0.0, 0, 0, 0.0]])
    old = torch.log(torch.full((2, 4), 0.5))
    spsq = torch.full((2, 4), 0.5)
    group = torch.tensor([0, 0])
    adv, _ = get_advantage_estimator("optimal_token_baseline")(
        rewards, mask, group, old_logprobs=old, sum_pi_squared=spsq
    )
    # W row 0 = (0.5, 1, 1.5, 2), row 1 = (0.5, -, -, 1); G row 0 = 1 everywhere, row 1 = 0
    b0 = (1 * 0.5) / (0.5 + 0.5 + 1e-8)
    b3 = (1 * 2.0) / (2.0 + 1.0 + 1e-8)
    want = torch.tensor([[1 - b0, 1.0, 1.0, 1 - b3], [-b0, 0.0, 0.0, -b3]])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)
    verl_adv, _ = verl_optimal_token_baseline(rewards, mask, group, old, spsq)
    assert verl_adv[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    assert verl_adv[0, 3].item() == pytest.approx(1.0)
    assert (adv - verl_adv).abs().max().item() == pytest.approx(1.0, abs=1e-6)
