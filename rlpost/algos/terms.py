"""The terms a trainer adds to any policy loss: KL to the reference, NLL, entropy bonus.

Each is ``fn(x: LossInputs, ...) -> scalar``, reduced with the mini-batch's denominators
so that, like the policy losses, it is the same however a mini-batch is split. The
trainer adds ``coef * term`` for each term whose coefficient is not 0.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rlpost.algos.policy_losses import LossInputs


def kl_term(x: LossInputs, estimator: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``agg(kl(logprobs, ref_logprobs), mask)``: the KL-to-reference loss (GRPO, arXiv
    2402.03300; verl ``use_kl_loss``) with a registered estimator (``kl.py``)."""
    return x.agg.reduce(estimator(x.logprobs, x.ref_logprobs), x.response_mask)


def nll_term(x: LossInputs) -> Tensor:
    """Token-mean ``-logprobs`` over the rewarded samples (``x.rewarded`` ``[B, 1]``, with
    their own denominators ``x.nll_agg``): supervised pull towards what was rewarded."""
    return x.nll_agg.reduce(-x.logprobs, x.response_mask * x.rewarded)


def entropy_term(x: LossInputs) -> Tensor:
    """``agg(entropy, mask)``, the policy's mean token entropy (a bonus: its coefficient is
    negative in the loss)."""
    return x.agg.reduce(x.entropy, x.response_mask)
