"""More policy losses on the signature of ``policy_losses.py``: GMPO, DPPO, DRO, KL-Cov, Clip-Cov.

KL-Cov and Clip-Cov treat the tokens of highest advantage-logprob covariance differently. That
choice depends on the batch's split, so it is the loss's ``token_selector`` trait,
``select(logprobs, advantages, response_mask, params) -> bool [B, T]``, which the trainer calls
once per mini-batch and hands each micro-batch as ``x.selected``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.algos.aggregate import masked_mean
from rlpost.algos.policy_losses import (
    POLICY_LOSSES,
    TRUST_REGION,
    LossInputs,
    PolicyLossOutput,
    _approx_kl,
    _clipped_surrogate,
    _frac,
    _ratio,
    _raw_log_ratio,
    _token_divergence,
    _zero,
)
from rlpost.params import ClipCovParams, DPPOParams, DROParams, GMPOParams, KLCovParams


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(x: LossInputs, p: GMPOParams) -> PolicyLossOutput:
    """GMPO: the geometric mean of token ratios, clipped in log space (arXiv 2507.20673).

    ``d_t = lp - old`` (no +-20 clamp, as verl); ``c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t,
    -clip_low, clip_high))`` (sign-aware like PPO's clip, on the log-ratio);
    ``rho_i = exp(sum_t c_t m / n_i)``; every valid token of row i carries ``-A_i rho_i``, ``A_i``
    the row's mean advantage (verl's ``geo_mean`` under ``seq-mean-token-mean``)."""
    old, adv, mask = x.detached()
    log_ratio = _raw_log_ratio(x.logprobs, old, mask)
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -p.clip_low, p.clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_log_ratio = masked_mean(kept, mask, dim=-1)
    seq_adv = masked_mean(adv, mask, dim=-1)
    seq_loss = -seq_adv * torch.exp(seq_log_ratio)
    loss_mat = seq_loss[:, None].expand_as(x.logprobs)
    stats = {
        "clip_frac": _frac((kept != log_ratio) & (sign != 0), mask),
        "approx_kl": _approx_kl(x.logprobs, old, mask),
        "seq_ratio_mean": masked_mean(torch.exp(seq_log_ratio).detach(), mask.any(-1)),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("dppo", read_when=TRUST_REGION)
def dppo_loss(x: LossInputs, p: DPPOParams) -> PolicyLossOutput:
    """DPPO: a trust region on the divergence of the sampled token's probability (arXiv 2602.04879).

    ``L = -A sg(min(r, is_cap)) lp keep`` with ``r = exp(clamp(lp - old, +-20))``
    (gradient ``-A min(r, c) grad lp``: PPO's inside the region). ``p, q`` are the
    current and old probabilities of the sampled token; ``D`` is the binary KL
    ``q log(q/p) + (1-q) log((1-q)/(1-p))`` or the signed TV ``p - q``. The region is
    sign-aware like PPO's clip: a token is dropped once it moved past the threshold in the
    advantage's direction. verl's ``dppo_kl`` / ``dppo_tv``."""
    old, adv, mask = x.detached()
    log_ratio, ratio = _ratio(x.logprobs, old)
    lp = x.logprobs.detach()
    now, then = torch.exp(torch.clamp(lp, max=0.0)), torch.exp(torch.clamp(old, max=0.0))
    if p.divergence == "tv":
        up, down = now - then > p.tr_tv, then - now > p.tr_tv
    else:
        beyond = _token_divergence(lp, old, "binary_kl") > p.tr_kl
        up, down = beyond & (now > then), beyond & (now < then)
    keep = torch.where(adv > 0, ~up, ~down)
    weight = torch.clamp(ratio, max=p.is_cap).detach()
    loss_mat = torch.where(keep, -adv * weight * x.logprobs, torch.zeros_like(x.logprobs))
    stats = {
        "clip_frac": _frac(~keep, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
        "is_capped_frac": _frac(ratio > p.is_cap, mask),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("dro")
def dro_loss(x: LossInputs, p: DROParams) -> PolicyLossOutput:
    """DRO: ``L = -A lp + reg_coef/2 (lp - old)^2``, a quadratic trust region (arXiv
    2405.19107; verl's ``dro``)."""
    old, adv, mask = x.detached()
    log_ratio = _raw_log_ratio(x.logprobs, old, mask)
    loss_mat = -adv * x.logprobs + 0.5 * p.reg_coef * log_ratio**2
    stats = {"clip_frac": _zero(x), "approx_kl": _approx_kl(x.logprobs, old, mask)}
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


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
    logprobs: Tensor, advantages: Tensor, response_mask: Tensor, p: KLCovParams
) -> Tensor:
    """KL-Cov's tokens: the top ``kl_cov_ratio`` of valid tokens by covariance, bool ``[B, T]``."""
    cov = _covariance(logprobs, advantages, response_mask)
    valid = response_mask > 0
    return _top_fraction(cov, valid, p.kl_cov_ratio, int(valid.sum()))


def clip_cov_select(
    logprobs: Tensor, advantages: Tensor, response_mask: Tensor, p: ClipCovParams
) -> Tensor:
    """Clip-Cov's tokens: up to ``clip_cov_ratio`` of valid tokens with covariance in
    ``(clip_cov_lb, clip_cov_ub)``, highest first, bool ``[B, T]``."""
    cov = _covariance(logprobs, advantages, response_mask)
    valid = response_mask > 0
    band = valid & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
    return _top_fraction(cov, band, p.clip_cov_ratio, int(valid.sum()))


def _selection(x: LossInputs, select, p) -> Tensor:
    """The tokens the trainer chose for the mini-batch, or else chosen over ``x`` itself."""
    if x.selected is None:
        return select(x.logprobs, x.advantages, x.response_mask, p)
    return x.selected.detach().to(torch.bool)


@POLICY_LOSSES.register("kl_cov", token_selector=kl_cov_select)
def kl_cov_loss(x: LossInputs, p: KLCovParams) -> PolicyLossOutput:
    """KL-Cov: ``L = -A r + ppo_kl_coef |lp - old| [selected]``, no clipping (arXiv 2505.22617).

    The selected tokens (:func:`kl_cov_select`) collapse entropy fastest."""
    old, adv, mask = x.detached()
    chosen = _selection(x, kl_cov_select, p)
    log_ratio = _raw_log_ratio(x.logprobs, old, mask)
    ratio = torch.exp(log_ratio)
    penalty = torch.where(chosen, p.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(log_ratio))
    loss_mat = -adv * ratio + penalty
    stats = {
        "clip_frac": _frac(chosen, mask),
        "approx_kl": _approx_kl(x.logprobs, old, mask),
        "abs_kl": masked_mean(log_ratio.detach().abs(), mask),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("clip_cov", token_selector=clip_cov_select)
def clip_cov_loss(x: LossInputs, p: ClipCovParams) -> PolicyLossOutput:
    """Clip-Cov: PPO's clipped surrogate with the selected tokens' gradient removed (arXiv 2505.22617).

    ``L = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)) (1 - [selected])``;
    the selected tokens (:func:`clip_cov_select`) lie inside ``(clip_cov_lb, clip_cov_ub)``."""
    old, adv, mask = x.detached()
    chosen = _selection(x, clip_cov_select, p)
    log_ratio = _raw_log_ratio(x.logprobs, old, mask)
    ratio = torch.exp(log_ratio)
    surrogate, cut = _clipped_surrogate(adv, ratio, p.clip_low, p.clip_high)
    loss_mat = torch.where(chosen, torch.zeros_like(ratio), surrogate)
    stats = {
        "clip_frac": _frac(cut | chosen, mask),
        "cov_selected_frac": _frac(chosen, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)
