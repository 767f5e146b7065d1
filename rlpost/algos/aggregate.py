"""Masked reductions: token counting and loss aggregation live here and nowhere else.

A per-token loss matrix ``[B, T]`` becomes a scalar through an :class:`Aggregation` whose
denominators are explicit: the whole mini-batch's counts, so summed micro-batch losses equal
the mini-batch loss (``None``: the local counts). Masked entries are selected away with
``torch.where``, so padding changes neither value nor gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from rlpost.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation mode")

# verl adds 1e-8 to the variance before the inverse square root in masked_whiten.
WHITEN_EPS = 1e-8


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over entries where ``mask`` is set (``[B, T]``), whole or along ``dim``."""
    m = mask.to(x.dtype)
    picked = torch.where(m > 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * m
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x*m) / max(sum(m), 1)``: 0 for an empty mask (verl adds 1e-8 to the count)."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased variance over set mask entries, as verl's ``masked_var``; 0 below two."""
    n = mask.to(x.dtype).sum()
    mu = masked_mean(x, mask)
    sq = masked_sum((x - mu) ** 2, mask)
    return torch.where(n > 1, sq / (n - 1).clamp(min=1.0), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """``(x - mu) * rsqrt(var + 1e-8)`` over valid entries, as verl's ``masked_whiten``, 0 on
    padding."""
    mu = masked_mean(x, mask)
    out = (x - mu) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
    return torch.where(mask.to(x.dtype) > 0, out, torch.zeros_like(out))


def _nonempty_rows(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Number of rows of ``mask [B, T]`` with at least one valid token (scalar)."""
    return (mask.to(dtype).sum(-1) > 0).to(dtype).sum()


def _over_seqs(total: Tensor, mask: Tensor, num_seqs: float | None) -> Tensor:
    """``total / S``: S = ``num_seqs``, else the non-empty rows of ``mask``."""
    if num_seqs is not None:
        return total / num_seqs
    return total / _nonempty_rows(mask, total.dtype).clamp(min=1.0)


# Each mode is ``fn(loss_mat [B, T], mask [B, T], agg: Aggregation) -> scalar``.


@AGGREGATIONS.register("token-mean")
def reduce_token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """``sum_{i,t} L*m / N`` with N the global token count (DAPO token-level loss, arXiv 2503.14476)."""
    total = masked_sum(loss_mat, mask)
    if agg.num_tokens is not None:
        return total / agg.num_tokens
    return total / mask.to(loss_mat.dtype).sum().clamp(min=1.0)


@AGGREGATIONS.register("token-sum")
def reduce_token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """``sum_{i,t} L*m``, no denominator (verl's ``token-sum``): the gradient grows with the
    number of tokens, so the learning rate carries the scale. Micro-batch invariant as is."""
    return masked_sum(loss_mat, mask)


@AGGREGATIONS.register("seq-mean-token-sum")
def reduce_seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """``sum_i (sum_t L*m) / S`` with S the number of non-empty rows (or ``num_seqs``)."""
    return _over_seqs(masked_sum(loss_mat, mask), mask, agg.num_seqs)


@AGGREGATIONS.register("seq-mean-token-mean")
def reduce_seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """``sum_i [sum_t L*m / n_i] / S`` over non-empty rows (GRPO's sample-level mean, arXiv 2402.03300)."""
    return _over_seqs(masked_mean(loss_mat, mask, dim=-1).sum(), mask, agg.num_seqs)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def reduce_seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """Dr.GRPO: ``sum_{i,t} L*m / (S * C)``, C = ``norm_constant`` or T (arXiv 2503.20783)."""
    c = agg.norm_constant
    constant = float(c) if c is not None else float(mask.shape[-1])
    return reduce_seq_mean_token_sum(loss_mat, mask, agg) / constant


def get_aggregation(name: str):
    """The reduce function registered as ``name``; raises ``UnknownNameError`` listing valid modes."""
    return AGGREGATIONS.get(name)


@dataclass(frozen=True)
class Aggregation:
    """How a per-token loss matrix becomes a scalar: ``num_tokens`` and ``num_seqs`` are the
    whole mini-batch's; ``norm_constant``: Dr.GRPO's constant length (``None``: width T)."""

    mode: str = "token-mean"
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_constant: float | None = None
    fn: Callable | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.fn is None:
            object.__setattr__(self, "fn", get_aggregation(self.mode))
        for field_name in ("num_tokens", "num_seqs", "norm_constant"):
            value = getattr(self, field_name)
            if value is not None and not value > 0:
                raise ValueError(f"Aggregation.{field_name} must be > 0, got {value}")

    @classmethod
    def for_minibatch(
        cls, mask: Tensor, mode: str = "token-mean", norm_constant: float | None = None
    ) -> Aggregation:
        """An aggregation whose denominators are the counts of ``mask [B, T]`` (an empty
        mask: the local counts)."""
        return cls(mode, norm_constant=norm_constant).counts(mask)

    def counts(self, mask: Tensor) -> Aggregation:
        """This aggregation with the denominators of ``mask [B, T]`` (see :meth:`for_minibatch`)."""
        tokens = float(mask.to(torch.float64).sum())
        seqs = float(_nonempty_rows(mask, torch.float64))
        return replace(
            self, num_tokens=tokens if tokens > 0 else None, num_seqs=seqs if seqs > 0 else None
        )

    def reduce(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """Scalar loss from ``loss_mat [B, T]`` and ``mask [B, T]``."""
        if loss_mat.shape != mask.shape:
            raise ValueError(
                f"loss matrix shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}"
            )
        return self.fn(loss_mat, mask, self)
