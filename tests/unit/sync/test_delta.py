"""The bf16 delta codec: exact, sparse, refused on the wrong base (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.sync.delta import apply_delta, encode_delta


def changed_fraction(new: torch.Tensor, base: torch.Tensor) -> float:
    """Fraction of elements whose bf16 bit pattern differs between ``new`` and ``base``."""
    diff = new.to(torch.bfloat16).view(torch.int16) != base.view(torch.int16)
    return diff.float().mean().item()


def _step(base: torch.Tensor, lr: float, seed: int = 0) -> torch.Tensor:
    """``base`` after one Adam-like step: every element moves by about ``lr``."""
    g = torch.Generator().manual_seed(seed)
    return base.float() - lr * torch.randn(base.shape, generator=g).sign()


def test_delta_is_bit_exact_and_small_after_a_small_step():
    base = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    new = _step(base, 1e-6)
    enc = encode_delta(new, base, full_threshold=0.3)
    assert enc.codec == "delta"
    out = apply_delta(enc.parts, enc.meta, base)
    assert torch.equal(out.view(torch.int16), new.to(torch.bfloat16).view(torch.int16))
    frac = changed_fraction(new, base)
    assert enc.meta["n"] == round(frac * base.numel()) and 0 < frac < 0.3
    assert enc.parts["z"].numel() < 0.1 * base.numel() * 2  # well under a tenth of bf16


def test_unchanged_tensor_is_an_empty_delta():
    base = torch.randn(8, 8).to(torch.bfloat16)
    enc = encode_delta(base.float(), base, full_threshold=0.3)
    assert enc.codec == "delta" and enc.meta["n"] == 0
    assert torch.equal(apply_delta(enc.parts, enc.meta, base), base)


def test_large_change_no_base_or_new_shape_goes_whole():
    base = torch.randn(16, 16).to(torch.bfloat16)
    assert encode_delta(base.float() + 1.0, base, full_threshold=0.3).codec == "bf16"
    assert encode_delta(base.float(), None, full_threshold=0.3).codec == "bf16"
    assert encode_delta(torch.randn(4, 4), base, full_threshold=0.3).codec == "bf16"


def test_delta_on_a_different_base_gives_other_bits_and_a_wrong_shape_is_refused():
    base = torch.randn(64, 64).to(torch.bfloat16)
    new = _step(base, 2e-3)  # about half an ulp near 1: some elements change, some do not
    enc = encode_delta(new, base, full_threshold=1.0)
    assert 0 < enc.meta["n"] < base.numel()
    other = (base.float() + 1.0).to(torch.bfloat16)
    assert not torch.equal(apply_delta(enc.parts, enc.meta, other), new.to(torch.bfloat16))
    with pytest.raises(ValueError, match="delta is for shape"):
        apply_delta(enc.parts, enc.meta, torch.zeros(2, 2, dtype=torch.bfloat16))
