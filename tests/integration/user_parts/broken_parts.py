"""Algorithm parts with the mistakes a user makes; each must be refused in one line at load."""

import torch


def no_params(x):
    return x


def says_yes(x, params):
    return "yes"


def raises(x, params):
    raise ZeroDivisionError("division by zero")


def nan_advantage(token_level_rewards, response_mask, group):
    adv = torch.full_like(token_level_rewards, float("nan"))
    return adv, adv


def wrong_shape_kl(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).sum(-1)
