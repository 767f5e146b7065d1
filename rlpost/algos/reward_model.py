"""The Bradley-Terry loss of a scalar reward model on preference pairs.

``P(chosen beats rejected) = sigmoid(r_chosen - r_rejected)``, maximised in log-likelihood.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlpost.algos.policy_losses import PolicyLossOutput


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | None = None,
    num_pairs: float | None = None,
) -> PolicyLossOutput:
    """``-log sigmoid(r_c - r_r - m)`` summed over pairs, divided by ``num_pairs`` (or B).

    InstructGPT (arXiv 2203.02155, eq. 1), the margin Llama 2's (arXiv 2307.09288, eq. 2)."""
    if rejected_rewards.shape != chosen_rewards.shape:
        raise ValueError(
            f"rejected_rewards shape {tuple(rejected_rewards.shape)} != chosen_rewards shape "
            f"{tuple(chosen_rewards.shape)}"
        )
    if margin is not None and margin.shape != chosen_rewards.shape:
        raise ValueError(
            f"margin shape {tuple(margin.shape)} != chosen_rewards shape "
            f"{tuple(chosen_rewards.shape)}"
        )
    diff = chosen_rewards - rejected_rewards
    shifted = diff if margin is None else diff - margin.to(diff.dtype)
    per_pair = -F.logsigmoid(shifted)
    denom = float(num_pairs) if num_pairs is not None else float(max(per_pair.numel(), 1))
    with torch.no_grad():
        d = diff.detach().float()
        stats = {
            "accuracy": ((d > 0).float() + 0.5 * (d == 0).float()).mean(),
            "reward_margin": d.mean(),
            "chosen_reward": chosen_rewards.detach().float().mean(),
            "rejected_reward": rejected_rewards.detach().float().mean(),
        }
    return PolicyLossOutput(per_pair.sum() / denom, stats)
