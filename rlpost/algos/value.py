"""Critic loss for PPO: clipped squared error to the GAE returns.

Value clipping as verl's ``compute_value_loss``; aggregated as the policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.algos.aggregate import Aggregation, masked_mean, masked_var
from rlpost.algos.policy_losses import PolicyLossOutput, _same_shape

# Guards the explained-variance ratio when the returns are constant.
EXPLAINED_VAR_EPS = 1e-8


def value_loss(
    values_pred: Tensor,
    returns: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    *,
    agg: Aggregation,
    clip_range: float | None = 0.2,
) -> PolicyLossOutput:
    """``1/2 max((v - R)^2, (clip(v, v_old +- c) - R)^2)`` (arXiv 1707.06347; verl), ``[B, T]``
    -> scalar; ``clip_range=None``: ``1/2 (v - R)^2``."""
    inputs = {"returns": returns, "old_values": old_values, "response_mask": response_mask}
    _same_shape("values_pred", values_pred, **inputs)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value clip_range must be > 0 or None, got {clip_range}")
    target, old, mask = returns.detach(), old_values.detach(), response_mask.detach() > 0
    err = (values_pred - target) ** 2
    if clip_range is None:
        loss_mat = 0.5 * err
        clipped_flags = torch.zeros_like(mask)
    else:
        # not old + clamp(v - old, -c, c), which rounds v off by a step when nothing clips
        clipped = torch.clamp(values_pred, old - clip_range, old + clip_range)
        err_clipped = (clipped - target) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        clipped_flags = err_clipped > err
    with torch.no_grad():
        residual_var = masked_var(target - values_pred, mask)
        target_var = masked_var(target, mask)
        # Undefined when the returns do not vary (e.g. every reward equal): NaN, not -1e6.
        explained = torch.where(
            target_var > EXPLAINED_VAR_EPS,
            1.0 - residual_var / target_var.clamp(min=EXPLAINED_VAR_EPS),
            torch.full_like(target_var, float("nan")),
        )
        stats = {
            "vf_clip_frac": masked_mean(clipped_flags.to(torch.float32), mask),
            "vf_explained_var": explained,
            "vpred_mean": masked_mean(values_pred, mask),
        }
    return PolicyLossOutput(agg.reduce(loss_mat, mask), stats)
