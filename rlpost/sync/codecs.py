"""Weight codecs: how one tensor is written on the wire, and read back.

A codec turns a tensor into named parts plus a JSON ``meta`` dict, and back; sender and
receiver ask the :data:`CODECS` registry's traits.

* ``none``: the trainer's tensor as is.
* ``bf16``: cast to bfloat16 (exact for a bf16 trainer, the usual serving dtype).
* ``fp8``: float8 e4m3 in 128x128 blocks, one fp32 scale each (DeepSeek-V3,
  arXiv:2412.19437, section 3.3).
* ``mxfp4``: OCP MXFP4 (MX spec v1.0, section 5.3): e2m1 in 32-element blocks, one E8M0
  scale each.

Under both, ``keep_bf16`` matches and tensors not 2-D go as bf16. e2m1 is by hand: torch's
``float4_e2m1fn_x2`` has no CPU conversion kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rlpost.registry import Registry

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8 e4m3fn
MX_BLOCK = 32
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes; codes 0-7, sign is bit 3
E2M1_EMAX = 2  # exponent of 4.0, the largest power of two in the grid
DEFAULT_KEEP_BF16 = ("embed", "lm_head", "norm")


@dataclass
class Encoded:
    """One tensor as a codec wrote it: ``parts`` travel, ``meta`` goes in the manifest."""

    codec: str
    parts: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)


Encoder = Callable[[torch.Tensor], Encoded]
Shape = Callable[[dict[str, tuple], dict], tuple]  # decoded shape from the parts' shapes, meta


@dataclass(frozen=True)
class Codec:
    encode: Encoder | None  # None: encoded by its own function (the delta needs a base)
    decode: Callable[..., torch.Tensor]  # (parts, meta) or, with needs_base, (parts, meta, base)
    shape: Shape


CODECS: Registry[Codec] = Registry("weight codec")


def codec_names(wire: bool = False) -> list[str]:
    """The values of ``sync.codec`` (``wire=True``: also what a manifest may name)."""
    return (
        CODECS.names() if wire else [n for n in CODECS.names() if not CODECS.trait(n, "needs_base")]
    )


def lookup(name: str) -> Codec:
    """The codec ``sync.codec`` names; an unknown one is a ValueError listing the valid ones."""
    if name not in codec_names():
        raise ValueError(f"unknown codec {name!r}; valid: {', '.join(codec_names())}")
    return CODECS.get(name)


def part_shape(part: str) -> Shape:
    """The decoded tensor has the shape of part ``part``."""
    return lambda shapes, meta: tuple(shapes[part])


def meta_shape(shapes: dict[str, tuple], meta: dict) -> tuple:
    """The decoded tensor has the shape the encoder wrote into ``meta``."""
    return tuple(meta["shape"])


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over a copy of ``data`` (``torch.frombuffer`` refuses an empty buffer)."""
    if not data:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


def keeps_bf16(name: str, tensor: torch.Tensor, patterns: Sequence[str]) -> bool:
    """True when a lossy codec must leave ``name`` in bf16: not 2-D, empty, a kept pattern,
    or holding a NaN or an infinity (block scales would turn those into finite numbers)."""
    if tensor.dim() != 2 or tensor.numel() == 0 or any(re.search(p, name) for p in patterns):
        return True
    return not bool(torch.isfinite(tensor).all())


def encode(
    name: str, tensor: torch.Tensor, codec: str, keep_bf16: Sequence[str] = DEFAULT_KEEP_BF16
) -> Encoded:
    """``tensor`` (detached, any device) encoded with ``codec``; kept tensors fall back to bf16."""
    t = tensor.detach().cpu()
    chosen = lookup(codec)
    if CODECS.trait(codec, "lossy") and keeps_bf16(name, t, keep_bf16):
        chosen = lookup("bf16")
    return chosen.encode(t)


def decode(enc: Encoded) -> torch.Tensor:
    """A tensor without a base (a delta is decoded by the receiver, against its copy)."""
    return lookup(enc.codec).decode(enc.parts, enc.meta)


def _plain(codec: str, dtype: torch.dtype | None) -> Codec:
    """A codec that sends the tensor itself as part ``data`` (cast to ``dtype``, if any)."""
    return Codec(
        lambda t: Encoded(codec, {"data": t.to(dtype or t.dtype).contiguous()}),
        lambda parts, meta: parts["data"],
        part_shape("data"),
    )


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[R, C]`` zero-padded and viewed as ``[R/rows, C/cols, rows, cols]`` blocks."""
    r, c = x.shape
    x = F.pad(x, (0, -c % cols, 0, -r % rows))
    br, bc = x.shape[0] // rows, x.shape[1] // cols
    return x.reshape(br, rows, bc, cols).permute(0, 2, 1, 3)


def _unblock(b: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    br, bc, rows, cols = b.shape
    return b.permute(0, 2, 1, 3).reshape(br * rows, bc * cols)[: shape[0], : shape[1]]


def _encode_fp8(t: torch.Tensor) -> Encoded:
    b = _blocks(t.float(), FP8_BLOCK, FP8_BLOCK)
    amax = b.abs().amax(dim=(2, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = _unblock(q, t.shape).contiguous()  # the padding is not sent
    return Encoded("fp8", {"q": q, "scale": scale.reshape(amax.shape[:2])})


def _decode_fp8(parts: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    q = parts["q"]
    b = _blocks(q.float(), FP8_BLOCK, FP8_BLOCK) * parts["scale"][:, :, None, None]
    return _unblock(b, q.shape).contiguous()


def _encode_mxfp4(t: torch.Tensor) -> Encoded:
    x = t.float()
    rows, cols = x.shape
    x = F.pad(x, (0, -cols % MX_BLOCK)).reshape(rows, -1, MX_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # Shared exponent floor(log2(amax)) - emax(e2m1), per the MX spec; all-zero blocks get 2^-127.
    exp = torch.where(
        amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.full_like(amax, -127)
    )
    exp = exp.clamp(-127, 127)
    scaled = (x / torch.exp2(exp)).clamp(-6.0, 6.0)  # values above 6 saturate, as the spec says
    grid = torch.tensor(E2M1_GRID)
    mid = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(scaled.abs(), mid, right=False).to(torch.uint8)  # ties round down
    code |= (scaled < 0).to(torch.uint8) << 3
    code = code.reshape(rows, -1)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # two nibbles per byte, low nibble first
    scales = (exp + 127).to(torch.uint8).reshape(rows, -1)
    return Encoded("mxfp4", {"q": packed.contiguous(), "scale": scales}, {"shape": [rows, cols]})


def _decode_mxfp4(parts: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    rows, cols = meta["shape"]
    packed = parts["q"]
    code = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, -1).long()
    grid = torch.tensor(E2M1_GRID)
    value = grid[code & 7] * torch.where(code >= 8, -1.0, 1.0)
    exp = parts["scale"].float() - 127
    value = value.reshape(rows, -1, MX_BLOCK) * torch.exp2(exp)[:, :, None]
    return value.reshape(rows, -1)[:, :cols].contiguous()


CODECS.register("none", identity=True, exact=True)(_plain("none", None))
CODECS.register("bf16", exact=True, bit_patterns=True)(_plain("bf16", torch.bfloat16))
CODECS.register("fp8", lossy=True)(Codec(_encode_fp8, _decode_fp8, part_shape("q")))
CODECS.register("mxfp4", lossy=True)(Codec(_encode_mxfp4, _decode_mxfp4, meta_shape))
