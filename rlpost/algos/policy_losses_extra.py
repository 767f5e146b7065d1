"""More policy losses on the signature of ``policy_losses.py``: GMPO, DPPO, DRO, KL-Cov, Clip-Cov.

Same contract: gradients only through ``logprobs``, every other input
detached, the ``[B, T]`` loss matrix reduced by ``agg`` so each loss works with
every aggregation mode and stays micro-batch invariant.

KL-Cov and Clip-Cov treat a small fraction of tokens differently, chosen by
the covariance between advantage and log-probability over the batch. A
choice over "the batch" depends on how the batch is split, so it is a
separate function registered as the loss's ``token_selector`` trait:
``select(logprobs, advantages, response_mask, **loss_params) -> bool [B, T]``.
The trainer calls it once per optimizer mini-batch (with the sampling policy's
logprobs) and hands each micro-batch its rows as ``selected``; called without
``selected``, the loss selects over the tensors it was given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.algos.aggregate import Aggregation, masked_mean
from rlpost.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossOutput,
    _approx_kl,
    _check_clip,
    _check_trust,
    _clipped_surrogate,
    _frac,
    _prepare,
    _ratio,
    _raw_log_ratio,
    _token_divergence,
)

# verl's defaults for the covariance-selected fraction and Clip-Cov's band.
KL_COV_RATIO = 2e-4
CLIP_COV_RATIO = 2e-4
CLIP_COV_LB = 1.0
CLIP_COV_UB = 5.0


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> PolicyLossOutput:
    """GMPO: the geometric mean of token ratios, clipped in log space (arXiv 2507.20673).

    ``d_t = lp - old`` (no +-20 clamp, as verl); ``c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t,
    -clip_low, clip_high))`` (sign-aware like PPO's clip, on the log-ratio);
    ``rho_i = exp(sum_t c_t m / n_i)``; every valid token of row i carries
    ``-A_i rho_i`` with ``A_i`` the row's mean advantage. With
    ``seq-mean-token-mean`` this is the paper's (and verl's ``geo_mean``)
    ``mean_i(-A_i rho_i)``. Default range ``(e^-0.4, e^0.4)`` is the paper's.
    Shapes ``[B, T]`` -> scalar; ``clip_frac`` = tokens whose log-ratio the sign-aware
    clip replaced (verl's ``pg_clipfrac`` counts other tokens, see docs/algorithms.md).
    """
    old, adv, mask = _prepare(logprobs, old_logprobs, advantages, response_mask)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"gmpo needs clip_low, clip_high >= 0, got {clip_low}, {clip_high}")
    log_ratio = _raw_log_ratio(logprobs, old, mask)
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_log_ratio = masked_mean(kept, mask, dim=-1)
    seq_adv = masked_mean(adv, mask, dim=-1)
    seq_loss = -seq_adv * torch.exp(seq_log_ratio)
    loss_mat = seq_loss[:, None].expand_as(logprobs)
    stats = {
        "clip_frac": _frac((kept != log_ratio) & (sign != 0), mask),
        "approx_kl": _approx_kl(logprobs, old, mask),
        "seq_ratio_mean": masked_mean(torch.exp(seq_log_ratio).detach(), mask.any(-1)),
    }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("dppo")
def dppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    divergence: str = "binary_kl",
    tr_kl: float = 0.05,
    tr_tv: float = 0.2,
    is_cap: float = 20.0,
) -> PolicyLossOutput:
    """DPPO: a trust region on the divergence of the sampled token's probability (arXiv 2602.04879).

    ``L = -A sg(min(r, is_cap)) lp keep`` with ``r = exp(clamp(lp - old, +-20))``
    (gradient ``-A min(r, c) grad lp``: PPO's inside the region). ``p, q`` are the
    current and old probabilities of the sampled token; ``D`` is the binary KL
    ``q log(q/p) + (1-q) log((1-q)/(1-p))`` or the signed TV ``p - q``. The region is
    sign-aware like PPO's clip: with ``A > 0`` a token is dropped when it has
    moved up past the threshold (``p > q`` and ``D > tr_kl``, or ``p - q > tr_tv``),
    with ``A <= 0`` when it has moved down past it. verl's ``dppo_kl`` /
    ``dppo_tv`` (one threshold for both sides here). Shapes ``[B, T]`` -> scalar.
    Stats: ``clip_frac`` (dropped tokens), ``is_capped_frac``, ``approx_kl`` of the
    clamped log-ratio.
    """
    old, adv, mask = _prepare(logprobs, old_logprobs, advantages, response_mask)
    _check_trust("dppo", divergence, is_cap)
    log_ratio, ratio = _ratio(logprobs, old)
    lp = logprobs.detach()
    p, q = torch.exp(torch.clamp(lp, max=0.0)), torch.exp(torch.clamp(old, max=0.0))
    if divergence == "tv":
        up, down = p - q > tr_tv, q - p > tr_tv
    else:
        beyond = _token_divergence(lp, old, "binary_kl") > tr_kl
        up, down = beyond & (p > q), beyond & (p < q)
    keep = torch.where(adv > 0, ~up, ~down)
    weight = torch.clamp(ratio, max=is_cap).detach()
    loss_mat = torch.where(keep, -adv * weight * logprobs, torch.zeros_like(logprobs))
    stats = {
        "clip_frac": _frac(~keep, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
        "is_capped_frac": _frac(ratio > is_cap, mask),
    }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("dro")
def dro_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    reg_coef: float = 1.0,
) -> PolicyLossOutput:
    """DRO: ``L = -A lp + reg_coef/2 (lp - old)^2``, a policy gradient held near the sampler.

    The squared log-ratio penalty replaces clipping with a quadratic trust
    region: its gradient ``reg_coef (lp - old)`` pulls each token back towards the
    policy that sampled it. Direct Reward Optimisation, Richemond et al., arXiv
    2405.19107 (the per-token form of the Tinker cookbook's ``dro`` loss; verl's ``dro``).
    ``lp - old`` is not clamped (as verl). Shapes ``[B, T]`` -> scalar. ``clip_frac`` is 0.
    """
    old, adv, mask = _prepare(logprobs, old_logprobs, advantages, response_mask)
    if reg_coef < 0:
        raise ValueError(f"dro reg_coef must be >= 0, got {reg_coef}")
    log_ratio = _raw_log_ratio(logprobs, old, mask)
    loss_mat = -adv * logprobs + 0.5 * reg_coef * log_ratio**2
    stats = {
        "clip_frac": logprobs.new_zeros((), dtype=torch.float32),
        "approx_kl": _approx_kl(logprobs, old, mask),
    }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)


def _covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``(A - mean A)(lp - mean lp)`` over valid tokens, ``-inf`` on padding."""
    m = mask > 0
    lp, adv = logprobs.detach().to(torch.float64), advantages.detach().to(torch.float64)
    cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
    return torch.where(m, cov, torch.full_like(cov, -torch.inf))


def _top_fraction(scores: Tensor, eligible: Tensor, fraction: float, valid: int) -> Tensor:
    """Bool ``[B, T]``: the ``max(1, int(fraction * valid))`` highest ``scores`` among ``eligible``."""
    selected = torch.zeros_like(eligible)
    count = min(max(1, int(fraction * valid)), int(eligible.sum()))
    if count == 0:
        return selected
    flat = torch.where(eligible, scores, torch.full_like(scores, -torch.inf)).flatten()
    # Stable order: equal covariances are taken in row-major order, whatever the split.
    order = torch.sort(flat, descending=True, stable=True).indices[:count]
    selected.view(-1)[order] = True
    return selected


def kl_cov_select(
    logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *, kl_cov_ratio=KL_COV_RATIO, **_
) -> Tensor:
    """KL-Cov's tokens: the top ``kl_cov_ratio`` of valid tokens by covariance, bool ``[B, T]``."""
    cov = _covariance(logprobs, advantages, response_mask)
    valid = response_mask > 0
    return _top_fraction(cov, valid, kl_cov_ratio, int(valid.sum()))


def clip_cov_select(
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_cov_ratio=CLIP_COV_RATIO,
    clip_cov_lb=CLIP_COV_LB,
    clip_cov_ub=CLIP_COV_UB,
    **_,
) -> Tensor:
    """Clip-Cov's tokens: up to ``clip_cov_ratio`` of valid tokens with covariance in
    ``(clip_cov_lb, clip_cov_ub)``, highest first, bool ``[B, T]``."""
    cov = _covariance(logprobs, advantages, response_mask)
    valid = response_mask > 0
    band = valid & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    return _top_fraction(cov, band, clip_cov_ratio, int(valid.sum()))


def _selection(selected: Tensor | None, like: Tensor, select, logprobs, adv, mask, **params):
    if selected is None:
        return select(logprobs, adv, mask, **params)
    if selected.shape != like.shape:
        raise ValueError(f"selected shape {tuple(selected.shape)} != {tuple(like.shape)}")
    return selected.detach().to(torch.bool)


@POLICY_LOSSES.register("kl_cov", token_selector=kl_cov_select)
def kl_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    selected: Tensor | None = None,
    kl_cov_ratio: float = KL_COV_RATIO,
    ppo_kl_coef: float = 1.0,
) -> PolicyLossOutput:
    """KL-Cov: ``L = -A r + ppo_kl_coef |lp - old| [selected]``, no clipping (arXiv 2505.22617).

    The selected tokens (top ``kl_cov_ratio`` by the covariance of advantage and
    logprob, :func:`kl_cov_select`) are those whose updates collapse entropy
    fastest; a KL penalty holds them near the sampling policy while every other
    token gets the plain importance-weighted gradient. ``selected [B, T]`` is
    supplied by the trainer per mini-batch; without it the loss selects over its
    own inputs. ``r = exp(lp - old)``, not clamped (as verl). Shapes ``[B, T]`` -> scalar;
    ``clip_frac`` = selected fraction; ``abs_kl`` = masked mean of ``|lp - old|`` (what verl's
    ``kl_cov`` logs as ``ppo_kl``; ``approx_kl`` stays the signed mean of every loss).
    """
    old, adv, mask = _prepare(logprobs, old_logprobs, advantages, response_mask)
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    chosen = _selection(
        selected, logprobs, kl_cov_select, logprobs, adv, mask, kl_cov_ratio=kl_cov_ratio
    )
    log_ratio = _raw_log_ratio(logprobs, old, mask)
    ratio = torch.exp(log_ratio)
    penalty = torch.where(chosen, ppo_kl_coef * log_ratio.abs(), torch.zeros_like(log_ratio))
    loss_mat = -adv * ratio + penalty
    stats = {
        "clip_frac": _frac(chosen, mask),
        "approx_kl": _approx_kl(logprobs, old, mask),
        "abs_kl": masked_mean(log_ratio.detach().abs(), mask),
    }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("clip_cov", token_selector=clip_cov_select)
def clip_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    selected: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = CLIP_COV_RATIO,
    clip_cov_lb: float = CLIP_COV_LB,
    clip_cov_ub: float = CLIP_COV_UB,
) -> PolicyLossOutput:
    """Clip-Cov: PPO's clipped surrogate with the selected tokens' gradient removed (arXiv 2505.22617).

    ``L = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)) (1 - [selected])``;
    the selected tokens (:func:`clip_cov_select`) are the highest-covariance
    tokens inside the band ``(clip_cov_lb, clip_cov_ub)``. ``r = exp(lp - old)``, not
    clamped, and no dual clip (both as verl).
    Shapes ``[B, T]`` -> scalar. Stats: ``clip_frac`` (PPO-clipped or selected),
    ``cov_selected_frac``.
    """
    old, adv, mask = _prepare(logprobs, old_logprobs, advantages, response_mask)
    _check_clip(clip_low, clip_high)
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(f"clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
    params = {"clip_cov_ratio": clip_cov_ratio, "clip_cov_lb": clip_cov_lb}
    chosen = _selection(
        selected, logprobs, clip_cov_select, logprobs, adv, mask, clip_cov_ub=clip_cov_ub, **params
    )
    log_ratio = _raw_log_ratio(logprobs, old, mask)
    ratio = torch.exp(log_ratio)
    surrogate, cut = _clipped_surrogate(adv, ratio, clip_low, clip_high)
    loss_mat = torch.where(chosen, torch.zeros_like(ratio), surrogate)
    stats = {
        "clip_frac": _frac(cut | chosen, mask),
        "cov_selected_frac": _frac(chosen, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)
