"""Loss aggregation modes and masked statistics against hand-computed values (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import (
    AGGREGATIONS,
    Aggregation,
    get_aggregation,
    masked_mean,
    masked_var,
    masked_whiten,
)
from rlpost.registry import UnknownNameError

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("token-sum", 1 + 2 + 3 + 4),
        ("seq-mean-token-sum", (6 + 4) / 2),  # the empty row is not counted
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 4)),  # C defaults to the width T
    ],
)
def test_modes_hand_computed(mode, expected):
    assert Aggregation(mode).reduce(LOSS, MASK).item() == pytest.approx(expected)


def test_global_counts_and_norm_constant():
    assert Aggregation("token-mean", num_tokens=8).reduce(LOSS, MASK).item() == pytest.approx(
        10 / 8
    )
    assert Aggregation("seq-mean-token-sum", num_seqs=5).reduce(LOSS, MASK).item() == pytest.approx(
        2.0
    )
    assert Aggregation("seq-mean-token-mean", num_seqs=4).reduce(
        LOSS, MASK
    ).item() == pytest.approx(1.5)
    dr = Aggregation("seq-mean-token-sum-norm", num_seqs=5, norm_constant=10)
    assert dr.reduce(LOSS, MASK).item() == pytest.approx(10 / 50)


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_empty_mask_gives_zero_not_nan(mode):
    out = Aggregation(mode).reduce(LOSS, torch.zeros_like(MASK))
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_micro_batch_sum_equals_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 5, generator=gen)
    mask = (torch.rand(7, 5, generator=gen) > 0.4).float()
    mask[2] = 0.0
    agg = Aggregation.for_minibatch(mask, mode=mode, norm_constant=16)
    parts = sum(agg.reduce(loss[i : i + 3], mask[i : i + 3]) for i in range(0, 7, 3))
    torch.testing.assert_close(parts, agg.reduce(loss, mask))
    torch.testing.assert_close(
        agg.reduce(loss, mask), Aggregation(mode, norm_constant=16).reduce(loss, mask)
    )


def test_for_minibatch_counts():
    agg = Aggregation.for_minibatch(MASK, mode="seq-mean-token-mean")
    assert (agg.num_tokens, agg.num_seqs, agg.mode) == (4.0, 2.0, "seq-mean-token-mean")
    empty = Aggregation.for_minibatch(torch.zeros(2, 3))
    assert empty.num_tokens is None and empty.num_seqs is None


def test_padding_values_do_not_leak_into_value_or_gradient():
    loss = LOSS.clone()
    loss[MASK == 0] = float("inf")
    assert Aggregation().reduce(loss, MASK).item() == pytest.approx(2.5)
    x = LOSS.clone().requires_grad_(True)
    Aggregation("seq-mean-token-mean").reduce(x * 3.0, MASK).backward()
    expected = torch.tensor([[1 / 3 * 3 / 2] * 3 + [0.0], [3 / 2, 0, 0, 0], [0.0] * 4])
    torch.testing.assert_close(x.grad, expected)


def test_validation_errors():
    with pytest.raises(UnknownNameError, match="valid: seq-mean-token-mean"):
        Aggregation("token_mean")
    with pytest.raises(UnknownNameError):
        get_aggregation("mean")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        Aggregation(num_tokens=0)
    with pytest.raises(ValueError, match="mask shape"):
        Aggregation().reduce(LOSS, MASK[:, :2])
    assert callable(get_aggregation("token-mean"))


def test_masked_statistics():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 1e9, 1e9]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(x, m).item() == pytest.approx(26.5)
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([103 / 3, 3.0]))
    vals = [1.0, 2.0, 100.0, 3.0]
    mu = sum(vals) / 4
    var = sum((v - mu) ** 2 for v in vals) / 3  # unbiased, as verl
    assert masked_var(x, m).item() == pytest.approx(var, rel=1e-6)
    white = masked_whiten(x, m)
    expected = [
        [(v - mu) / math.sqrt(var + 1e-8) for v in (1.0, 2.0, 100.0)],
        [(3.0 - mu) / math.sqrt(var + 1e-8), 0, 0],
    ]
    torch.testing.assert_close(white, torch.tensor(expected))
    assert masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]])).item() == 0.0
