"""A policy loss from outside the package: PPO's clipped ratio, its clip a declared parameter."""

import torch
from pydantic import BaseModel

from rlpost.algos.policy_losses import PolicyLossOutput
from rlpost.registry import part


class ClipParams(BaseModel):
    clip: float = 0.2


@part(params=ClipParams)
def clipped(x, params):
    old, adv, mask = x.detached()
    ratio = torch.exp(x.logprobs - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - params.clip, 1 + params.clip) * adv)
    return PolicyLossOutput(x.agg.reduce(per_token, mask), {"clip": torch.tensor(params.clip)})
