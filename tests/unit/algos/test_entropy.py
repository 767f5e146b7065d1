"""Token entropy from logits (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import entropy_from_logits


def test_uniform_and_peaked():
    logits = torch.zeros(2, 3, 50)
    logits[1, :, 7] = 1e4
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h[0], torch.full((3,), math.log(50)))
    torch.testing.assert_close(h[1], torch.zeros(3), atol=1e-5, rtol=0)


def test_matches_definition_for_any_chunk_size():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log(p)).sum(-1)
    for chunk in (1, 4, 1000):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), expected)


def test_gradient_and_low_precision():
    logits = torch.randn(2, 4, 9, requires_grad=True)
    entropy_from_logits(logits, chunk_size=3).sum().backward()
    direct = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(direct, -1)
    (-(p * torch.log_softmax(direct, -1)).sum()).backward()
    torch.testing.assert_close(logits.grad, direct.grad)
    half = entropy_from_logits(logits.detach().to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(
        half.float(), entropy_from_logits(logits.detach()), atol=2e-2, rtol=2e-2
    )
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        entropy_from_logits(torch.zeros(3, 4))
