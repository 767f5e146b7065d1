"""DAPO's sampling-side helpers as pure functions (arXiv 2503.14476).

Dynamic sampling drops prompts whose group has no reward spread: with all
scores equal every group-relative advantage is zero, so those rows carry no
gradient but still dilute the token-mean denominator. The overlong soft penalty
replaces a cliff at the length limit by a linear ramp over the last
``cache_len`` tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (eq. 13), added to the outcome reward.

    Shapes: ``lengths [B]`` (response tokens) -> ``[B]`` float32:
    ``0`` if ``len <= max_len - cache_len``; ``((max_len - cache_len) - len) / cache_len
    * factor`` inside the window; ``-factor`` beyond ``max_len``. ``cache_len = 0``
    is a hard cliff at ``max_len``.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(
            f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    n = lengths.to(torch.float32)
    start = float(max_len - cache_len)
    ramp = (start - n) / float(max(cache_len, 1)) * factor
    penalty = torch.where(n <= start, torch.zeros_like(n), ramp)
    return torch.where(n > max_len, torch.full_like(n, -float(factor)), penalty)


def _group_range(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group ``max - min`` of ``scores [B]`` and the row->group inverse index ``[B]``."""
    if scores.shape != group.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group {tuple(group.shape)} must both be [B]"
        )
    _, inverse = torch.unique(group, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.to(torch.float64)
    empty = s.new_zeros(num_groups)
    high = empty.scatter_reduce(0, inverse, s, reduce="amax", include_self=False)
    low = empty.scatter_reduce(0, inverse, s, reduce="amin", include_self=False)
    return high - low, inverse


def groups_with_spread(scores: Tensor, group: Tensor) -> Tensor:
    """DAPO dynamic-sampling filter: True for rows whose group's scores are not all equal.

    Shapes: ``scores [B]``, ``group [B]`` int64 prompt ids (any order) -> bool ``[B]``.
    A singleton group has no spread and is dropped.
    """
    spread, inverse = _group_range(scores, group)
    return (spread > 0)[inverse]


def group_zero_spread_fraction(scores: Tensor, group: Tensor) -> float:
    """Fraction of groups (not rows) whose scores are all equal; 0.0 for an empty batch.

    Shapes: ``scores [B]``, ``group [B]``. A rising value means GRPO is starved
    of signal (every prompt all-right or all-wrong).
    """
    spread, _ = _group_range(scores, group)
    if spread.numel() == 0:
        return 0.0
    return float((spread == 0).to(torch.float64).mean())
