"""DAPO's sampling-side helpers as pure functions (arXiv 2503.14476).

Dynamic sampling drops groups without reward spread, which carry no gradient but dilute the
token-mean denominator.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    lengths: Tensor,
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """DAPO soft overlong punishment (eq. 13), ``lengths [B]`` -> ``[B]``: 0 up to ``max_len -
    cache_len``, then a ramp to ``-factor`` at ``max_len`` and beyond."""
    if not 0 <= cache_len <= max_len:
        raise ValueError(
            f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    n = lengths.to(dtype)
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


def group_has_spread(scores: Tensor, group: Tensor) -> Tensor:
    """DAPO dynamic-sampling filter, per group: True where a group's scores are not all equal.

    ``[B]`` -> bool ``[G]`` by ascending id; a singleton or NaN group has no spread."""
    spread, _ = _group_range(scores, group)
    return spread > 0


def spread_per_group(scores: list[list[float]]) -> list[bool]:
    """:func:`group_has_spread` for groups given as lists of scores (the rollout stage's)."""
    if not scores:
        return []
    flat = torch.tensor([x for g in scores for x in g], dtype=torch.float64)
    ids = torch.tensor([i for i, g in enumerate(scores) for _ in g], dtype=torch.long)
    spread = group_has_spread(flat, ids).tolist()
    if len(spread) != len(scores):
        raise ValueError("every group needs at least one score")
    return spread


def groups_with_spread(scores: Tensor, group: Tensor) -> Tensor:
    """:func:`group_has_spread` per row: bool ``[B]``, True for rows whose group keeps."""
    _, inverse = torch.unique(group, return_inverse=True)
    return group_has_spread(scores, group)[inverse]


def group_zero_spread_fraction(scores: Tensor, group: Tensor) -> float:
    """Fraction of groups (not rows) whose scores are all equal; 0.0 for an empty batch."""
    spread, _ = _group_range(scores, group)
    if spread.numel() == 0:
        return 0.0
    return float((spread == 0).to(torch.float64).mean())
