"""A registered policy loss called on loose tensors, as the tests of its math want it."""

from __future__ import annotations

from dataclasses import fields

from rlpost.algos import get_policy_loss
from rlpost.algos.policy_losses import LossInputs
from rlpost.params import LossChoice, variants

INPUTS = {f.name for f in fields(LossInputs)}


def policy_loss(name: str):
    """``call(logprobs, old, advantages, mask, *, agg, **kw)``: the keywords that name a
    :class:`LossInputs` field go there, the rest build the loss's variant."""
    fn, variant = get_policy_loss(name), variants(LossChoice)[name]

    def call(logprobs, old_logprobs, advantages, response_mask, *, agg, **kw):
        given = {k: kw.pop(k) for k in list(kw) if k in INPUTS}
        x = LossInputs(logprobs, old_logprobs, advantages, response_mask, agg, **given)
        return fn(x, variant(**kw))

    return call
