"""The Bradley-Terry loss of a scalar reward model on preference pairs.

A reward model gives each (prompt, response) one number ``r``; under the Bradley-Terry
model the chance that the chosen response beats the rejected one is
``sigmoid(r_chosen - r_rejected)``, and training maximises its log-likelihood. An optional
per-pair margin asks the chosen reward to lead by at least that much before the pair stops
pulling (Llama 2's margin for pairs rated "significantly better").
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

    Shapes: ``chosen_rewards``, ``rejected_rewards`` and ``margin`` ``[B]`` -> scalar loss.
    Ouyang et al. 2022 (InstructGPT, arXiv 2203.02155, eq. 1); the margin ``m`` is Llama 2's
    (Touvron et al. 2023, arXiv 2307.09288, eq. 2); ``margin=None`` is ``m = 0``. Dividing
    by the whole mini-batch's pair count (``num_pairs``) makes the summed gradient of its
    micro-batches the mini-batch's. Stats (no gradient): ``accuracy`` (pairs with
    ``r_c > r_r``, a tie counting one half), ``reward_margin`` (mean ``r_c - r_r``),
    ``chosen_reward`` and ``rejected_reward`` (means).
    """
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
