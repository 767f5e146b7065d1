"""Codecs: hand-computed quantisation cases, error bounds, sizes (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.sync.codecs import codec_names, decode, encode


def _bytes(enc) -> int:
    return sum(p.numel() * p.element_size() for p in enc.parts.values())


def test_registry_names_and_unknown_codec_lists_them():
    assert codec_names() == ["bf16", "fp8", "mxfp4", "none"]
    with pytest.raises(ValueError, match="unknown codec 'int3'; valid: bf16, fp8, mxfp4, none"):
        encode("w", torch.zeros(2, 2), "int3")


def test_none_and_bf16_round_trip():
    x = torch.randn(7, 5)
    assert torch.equal(decode(encode("w", x, "none")), x)
    assert torch.equal(decode(encode("w", x, "bf16")), x.to(torch.bfloat16))


def test_fp8_hand_computed_block():
    # amax 448 -> scale exactly 1, so each value is its nearest e4m3 number:
    # 1.1 -> 1.125 (spacing 1/8 in [1, 2)); 300 -> 288 (spacing 32 in [256, 512));
    # -0.3 -> -0.3125 (spacing 1/32 in [0.25, 0.5)); 0.001 -> 2^-9, the nearest subnormal
    # (subnormals are multiples of 2^-9; 0.001 is 0.00095 from 2^-9 and 0.001 from 0).
    x = torch.tensor([[448.0, 1.1, 300.0, -0.3, 0.001]])
    enc = encode("layers.0.w", x, "fp8")
    assert enc.codec == "fp8" and enc.parts["scale"].tolist() == [[1.0]]
    assert decode(enc).tolist() == [[448.0, 1.125, 288.0, -0.3125, 2**-9]]


def test_fp8_error_bound_per_128x128_block():
    torch.manual_seed(0)
    x = torch.randn(300, 260) * torch.rand(300, 1) * 3  # rows of different scale, ragged blocks
    enc = encode("layers.0.w", x, "fp8")
    assert enc.parts["scale"].shape == (3, 3) and enc.parts["q"].shape == (300, 260)
    y = decode(enc)
    for bi, bj in [(0, 0), (2, 2), (1, 2)]:
        blk = x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
        out = y[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
        scale = blk.abs().max() / 448
        # e4m3: 3 mantissa bits -> half an ulp is 2^-4 of a normal value; subnormal spacing 2^-9.
        bound = blk.abs() * 2**-4 + scale * 2**-10
        assert ((out - blk).abs() <= bound * 1.001 + 1e-12).all()
        assert (out - blk).abs().max() > 0  # it is lossy: the bound is not vacuous


def test_fp8_keeps_embeddings_norms_and_1d_in_bf16():
    w = torch.randn(64, 64)
    assert encode("model.embed_tokens.weight", w, "fp8").codec == "bf16"
    assert encode("lm_head.weight", w, "fp8").codec == "bf16"
    assert encode("model.layers.0.mlp.up_proj.weight", w, "fp8").codec == "fp8"
    assert encode("model.layers.0.mlp.up_proj.bias", torch.randn(64), "fp8").codec == "bf16"
    assert encode("model.embed_tokens.weight", w, "fp8", keep_bf16=()).codec == "fp8"


def test_fp8_is_about_half_of_bf16():
    w = torch.randn(256, 512)
    ratio = _bytes(encode("w", w, "fp8")) / _bytes(encode("w", w, "bf16"))
    assert ratio == pytest.approx(0.5 + 8 * 4 / (2 * 256 * 512))  # + one fp32 scale per block


def test_mxfp4_hand_computed_blocks():
    # Block 1: amax 7 -> shared exponent floor(log2 7) - 2 = 0, scale 1:
    # 0.3 -> 0.5, -1.2 -> -1, 2.6 -> 3, 7 -> 6 (saturates), 5.2 -> 6, 0 -> 0.
    # Block 2 is block 1 times 1/4: scale 2^-2, same codes.
    first = [0.3, -1.2, 2.6, 7.0, 5.2] + [0.0] * 27
    x = torch.tensor([first + [v / 4 for v in first]])
    enc = encode("layers.0.w", x, "mxfp4")
    assert enc.parts["scale"].tolist() == [[127, 125]]  # E8M0: exponent + 127
    want = [0.5, -1.0, 3.0, 6.0, 6.0] + [0.0] * 27
    assert decode(enc).tolist() == [want + [v / 4 for v in want]]


def test_mxfp4_bound_ragged_rows_and_size():
    torch.manual_seed(1)
    x = torch.randn(64, 40)  # 40 columns: the second block of each row is padded
    enc = encode("layers.0.w", x, "mxfp4")
    y = decode(enc)
    assert y.shape == x.shape
    for blk, out in [(x[:, :32], y[:, :32]), (x[:, 32:], y[:, 32:])]:
        amax = blk.abs().amax(dim=1, keepdim=True)
        # scale = 2^(floor(log2 amax) - 2); grid gaps are at most 2 scales (4 -> 6), and
        # values between 6 and 8 scales saturate at 6: |error| < 2 scales = 2^(floor(log2 amax) - 1).
        bound = torch.exp2(torch.floor(torch.log2(amax)) - 1)
        assert ((out - blk).abs() < bound).all()
    assert enc.parts["q"].shape == (64, 32) and enc.parts["scale"].shape == (64, 2)
    w = torch.randn(64, 64)
    assert _bytes(encode("w", w, "mxfp4")) / _bytes(encode("w", w, "bf16")) == pytest.approx(
        (0.5 + 1 / 32) / 2
    )


def test_zero_block_survives_every_codec():
    x = torch.zeros(4, 64)
    for codec in ("none", "bf16", "fp8", "mxfp4"):
        y = decode(encode("w", x, codec))
        assert torch.equal(y.float(), x) and not math.isnan(y.float().sum().item())
