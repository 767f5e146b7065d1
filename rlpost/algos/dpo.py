"""Direct preference losses on summed sequence log-probabilities.

The implicit reward is ``beta (log pi - log pi_ref)``; the losses see only
``h = (pc - rc) - (pr - rr)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlpost.algos.policy_losses import PolicyLossOutput

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    num_pairs: float | None = None,
) -> PolicyLossOutput:
    """DPO (Rafailov et al., arXiv 2305.18290 eq. 7) or IPO (Azar et al., arXiv 2310.12036).

    Four ``[B]`` tensors -> scalar. ``sigmoid``: ``-(1-ls) log sigmoid(beta h) - ls log
    sigmoid(-beta h)`` (conservative DPO); ``ipo``: ``(h - 1/(2 beta))^2``. Summed over
    pairs and divided by ``num_pairs`` (the mini-batch's) or B."""
    shape = policy_chosen_logps.shape
    for name, t in (
        ("policy_rejected_logps", policy_rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        if t.shape != shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} != policy_chosen_logps shape {tuple(shape)}"
            )
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_ratio = policy_rejected_logps - ref_rejected_logps.detach()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = -(1.0 - label_smoothing) * F.logsigmoid(
            beta * h
        ) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    denom = float(num_pairs) if num_pairs is not None else float(max(per_pair.numel(), 1))
    with torch.no_grad():
        chosen_reward = beta * chosen_ratio
        rejected_reward = beta * rejected_ratio
        stats = {
            "chosen_reward": chosen_reward.mean(),
            "rejected_reward": rejected_reward.mean(),
            "reward_margin": (chosen_reward - rejected_reward).mean(),
            "reward_accuracy": (chosen_reward > rejected_reward).to(torch.float32).mean(),
        }
    return PolicyLossOutput(per_pair.sum() / denom, stats)
