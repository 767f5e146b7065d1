"""An advantage estimator from outside the package: the score minus its group's median."""

import torch


def median_baseline(token_level_rewards, response_mask, group, scale=1.0):
    scores = token_level_rewards.sum(-1)
    adv = torch.zeros_like(scores)
    for g in group.unique():
        rows = group == g
        adv[rows] = scores[rows] - scores[rows].median()
    adv = (scale * adv)[:, None] * response_mask
    return adv, adv
