"""Rollout corrections: importance weights between the policy that sampled and the one trained.

The behaviour policy ``mu`` (``rollout_logprobs``) differs from the proximal policy the loss
uses (``old_logprobs``) under stale weights or different engine numerics. Each correction
returns a detached weight ``w [B, T] >= 0`` multiplied into the advantages; 0 masks a token.

``fn(proximal_logprobs, rollout_logprobs, response_mask, p) -> CorrectionOutput``, ``p`` the
variant of ``algo.rollout_correction``; ``d = prox - mu`` is clamped to +-20. With one step
per batch the proximal logprobs are the loss pass's own (AReaL, arXiv 2505.24298, eq. 5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlpost.algos.aggregate import masked_mean, masked_sum
from rlpost.algos.policy_losses import LOG_RATIO_CLAMP
from rlpost.params import MaskCorrection, SeqMaskCorrection, TISCorrection
from rlpost.registry import Registry


@dataclass
class CorrectionOutput:
    """Per-token weights ``[B, T]`` (detached) and detached scalar statistics."""

    weights: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


Correction = Callable[..., CorrectionOutput]
CORRECTIONS: Registry[Correction] = Registry("rollout correction")


def get_correction(name: str) -> Correction:
    """The correction registered as ``name``; raises ``UnknownNameError`` listing valid names."""
    return CORRECTIONS.get(name)


def _log_ratio(prox: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
    """``d = prox - mu`` ``[B, T]`` clamped to +-20, 0 on padding (shapes checked)."""
    if prox.shape != rollout.shape or mask.shape != prox.shape:
        raise ValueError(
            f"correction shapes differ: proximal {tuple(prox.shape)}, rollout "
            f"{tuple(rollout.shape)}, mask {tuple(mask.shape)}"
        )
    d = (prox.detach() - rollout.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask > 0, d, torch.zeros_like(d))


def _output(weights: Tensor, mask: Tensor, masked: Tensor | None = None) -> CorrectionOutput:
    """``weights`` zeroed on padding and ``masked`` tokens, with their mean, the effective
    sample size fraction ``(sum w)^2 / (N sum w^2)`` and the masked fraction."""
    m = mask > 0
    masked = torch.zeros_like(m) if masked is None else masked
    w = torch.where(m & ~masked, weights, torch.zeros_like(weights))
    total = masked_sum(w, m)
    square = masked_sum(w**2, m)
    n = m.to(w.dtype).sum().clamp(min=1.0)
    ess = torch.where(square > 0, total**2 / (n * square), torch.zeros_like(total))
    stats = {
        "is_weight_mean": masked_mean(w, m),
        "is_ess": ess,
        "is_masked_frac": masked_mean(masked.to(w.dtype), m),
    }
    return CorrectionOutput(w, stats)


@CORRECTIONS.register("tis")
def token_tis(
    proximal_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, p: TISCorrection
) -> CorrectionOutput:
    """Token-level truncated IS ``w_t = min(exp(d_t), cap)`` (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training")."""
    d = _log_ratio(proximal_logprobs, rollout_logprobs, response_mask)
    return _output(torch.exp(d).clamp(max=p.cap), response_mask)


@CORRECTIONS.register("seq_tis")
def sequence_tis(
    proximal_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, p: TISCorrection
) -> CorrectionOutput:
    """Sequence-level truncated IS ``w_i = min(exp(sum_t d_it), cap)`` on every token of row i
    (the sequence's likelihood ratio; unbiased for sequence-level rewards, higher variance)."""
    d = _log_ratio(proximal_logprobs, rollout_logprobs, response_mask)
    seq = torch.exp(d.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=p.cap)
    return _output(seq[:, None].expand_as(d), response_mask)


@CORRECTIONS.register("mask")
def token_mask(
    proximal_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, p: MaskCorrection
) -> CorrectionOutput:
    """Masked IS (IcePop, "Every step evolves", arXiv 2510.18855): ``w_t = exp(d_t)`` inside
    ``[low, high]``, 0 outside: tokens the two policies disagree on do not train."""
    r = torch.exp(_log_ratio(proximal_logprobs, rollout_logprobs, response_mask))
    outside = ((r < p.low) | (r > p.high)) & (response_mask > 0)
    return _output(r, response_mask, outside)


@CORRECTIONS.register("seq_mask")
def sequence_mask(
    proximal_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, p: SeqMaskCorrection
) -> CorrectionOutput:
    """Masked IS by sequence: a row any of whose tokens' ratio leaves ``[low, high]`` is
    dropped whole (weight 0); the others keep ``w_t = min(exp(d_t), cap)``."""
    r = torch.exp(_log_ratio(proximal_logprobs, rollout_logprobs, response_mask))
    valid = response_mask > 0
    bad_row = (((r < p.low) | (r > p.high)) & valid).any(-1, keepdim=True)
    return _output(r.clamp(max=p.cap), response_mask, bad_row.expand_as(r) & valid)
