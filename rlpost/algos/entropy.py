"""Token entropy of the policy from its logits, without materialising softmax for all of T.

``H = logsumexp(z) - sum_v softmax(z)_v z_v`` per position, ``chunk_size`` positions at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits)``: ``[B, T, V]`` -> ``[B, T]``, in at least float32."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, vocab = logits.shape
    flat = logits.reshape(batch * length, vocab)
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].to(compute_dtype)
        log_norm = torch.logsumexp(z, dim=-1)
        probs = torch.softmax(z, dim=-1)
        pieces.append(log_norm - (probs * z).sum(-1))
    if not pieces:
        return logits.new_zeros(batch, length)
    return torch.cat(pieces).reshape(batch, length).to(logits.dtype)
