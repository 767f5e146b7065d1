"""The KL, NLL and entropy loss terms: hand-computed values and micro-batch invariance (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.algos import Aggregation, get_kl_estimator
from rlpost.algos.policy_losses import LossInputs, entropy_term, kl_term, nll_term


def k3_hand(x: float) -> float:
    return torch.expm1(torch.tensor(-x)).item() + x


def inputs(lp, mask, agg=None, **kw) -> LossInputs:
    agg = agg if agg is not None else Aggregation()
    return LossInputs(lp, lp.detach(), torch.zeros_like(lp), mask, agg, **kw)


def test_kl_term_aggregates_k3_over_valid_tokens():
    lp = torch.tensor([[-1.0, -2.0, 50.0]])
    ref = torch.tensor([[-1.5, -1.0, -50.0]])
    out = kl_term(inputs(lp, torch.tensor([[1, 1, 0]]), ref_logprobs=ref), get_kl_estimator("k3"))
    assert out.item() == pytest.approx((k3_hand(0.5) + k3_hand(-1.0)) / 2, rel=1e-6)


def test_nll_term_is_the_mean_over_rewarded_samples_only():
    lp = torch.tensor([[-1.0, -3.0], [-5.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewarded = torch.tensor([[1.0], [0.0]])
    nll_agg = Aggregation.for_minibatch(mask * rewarded, "token-mean")
    out = nll_term(inputs(lp, mask, rewarded=rewarded, nll_agg=nll_agg))
    assert out.item() == pytest.approx(2.0)  # row 0 only: (1 + 3) / 2


def test_entropy_term_splits_into_micro_batches():
    gen = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 5, generator=gen)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    lp = torch.zeros(4, 5)
    agg = Aggregation.for_minibatch(mask, "token-mean")
    whole = entropy_term(inputs(lp, mask, agg, entropy=entropy))
    parts = sum(
        entropy_term(inputs(lp[r], mask[r], agg, entropy=entropy[r]))
        for r in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, whole)
    assert whole.item() == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-6)
