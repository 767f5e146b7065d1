"""Advantage estimators that need more than rewards and groups, or change the group baseline.

Conventions as ``advantages.py``. A registry trait announces each extra input:

- ``needs_components``: ``components [B, K]``, each reward term's value per row (GDPO);
- ``needs_greedy_baseline``: ``baseline_scores [B]``, a greedy response's reward (ReMax);
- ``needs_sum_pi_squared``: ``sum_pi_squared [B, T]`` and ``old_logprobs [B, T]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.algos.advantages import (
    ADVANTAGES,
    _check,
    _group_centered,
    _group_index,
    _outcome_scores,
    _reward_to_go,
    _tile,
    outcome,
)


@ADVANTAGES.register("opo", group_relative=True)
@torch.no_grad()
def opo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """OPO: ``A_i = s_i - sum_g(n_j s_j) / sum_g(n_j)``, a length-weighted group baseline.

    ``n_j`` = valid tokens of row j, the paper's stand-in for the squared gradient norm
    (arXiv 2505.23585). A singleton or tokenless group gets baseline 0 (verl)."""
    _check(token_level_rewards, response_mask, group)
    scores = _outcome_scores(token_level_rewards)
    lengths = (response_mask.to(torch.float64) > 0).sum(-1).to(torch.float64)
    inverse, num_groups = _group_index(group)
    zeros = scores.new_zeros(num_groups)
    count = zeros.scatter_add(0, inverse, torch.ones_like(scores))[inverse]
    weight = zeros.scatter_add(0, inverse, lengths)[inverse]
    weighted = zeros.scatter_add(0, inverse, lengths * scores)[inverse]
    baseline = torch.where((count > 1) & (weight > 0), weighted / weight.clamp(min=1.0), 0.0)
    return _tile(scores - baseline, response_mask, token_level_rewards.dtype)


@outcome("grpo_passk", group_relative=True)
def grpo_passk_advantages(
    scores: Tensor, group: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Pass@k GRPO: only each group's best row gets ``(s_max - s_second) / (std_g + eps)``.

    Every other row gets 0: the leave-one-out gradient of pass@n (arXiv 2503.19595; verl's
    ``grpo_passk``). Ties go to the first row. Needs groups of at least 2 rows."""
    _, std, count = _group_centered(scores, group)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group (rollout.n >= 2)")
    inverse, num_groups = _group_index(group)
    adv = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = torch.nonzero(inverse == g).flatten()
        top, where = torch.topk(scores[rows], 2)  # topk keeps the first of equal values first
        margin = top[0] - top[1]
        adv[rows[where[0]]] = margin / (std[rows[0]] + eps) if norm_by_std else margin
    return adv


@outcome("gdpo", whiten=True, group_relative=True, needs_components=True)
def gdpo_advantages(
    scores: Tensor, group: Tensor, *, components: Tensor | None = None, eps: float = 1e-6
) -> Tensor:
    """GDPO: group-normalise each reward term, sum, then whiten over the batch.

    ``A_i = whiten_batch(sum_k (c_ik - mean_g c_k) / (std_g c_k + eps))`` (arXiv 2601.05242;
    verl's ``gdpo``). ``components [B, K]``, NaN counting as 0; without them the summed
    score is the only term."""
    if components is None:
        comps = scores[:, None]
    else:
        if components.dim() != 2 or components.shape[0] != group.shape[0]:
            raise ValueError(f"components must be [B, K], got {tuple(components.shape)}")
        comps = torch.nan_to_num(components.to(torch.float64), nan=0.0)
    total = torch.zeros(comps.shape[0], dtype=torch.float64)
    for k in range(comps.shape[1]):
        centered, std, _ = _group_centered(comps[:, k], group)
        total = total + centered / (std + eps)
    return total


@ADVANTAGES.register("remax", needs_greedy_baseline=True)
@torch.no_grad()
def remax_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax (arXiv 2310.10505): ``A_it = G_it - b_i``, ``G_it`` the reward-to-go and ``b_i``
    the greedy response's reward; no normalisation."""
    _check(token_level_rewards, response_mask, group)
    if baseline_scores is None:
        raise ValueError("advantage estimator 'remax' needs baseline_scores [B] (greedy rewards)")
    if baseline_scores.shape != group.shape:
        raise ValueError(f"baseline_scores must be [B], got {tuple(baseline_scores.shape)}")
    returns, m = _reward_to_go(token_level_rewards, response_mask)
    adv = torch.where(m, returns - baseline_scores.to(torch.float64)[:, None], 0.0)
    dtype = token_level_rewards.dtype
    return adv.to(dtype), torch.where(m, returns, 0.0).to(dtype)


@ADVANTAGES.register("optimal_token_baseline", group_relative=True, needs_sum_pi_squared=True)
@torch.no_grad()
def optimal_token_baseline_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline: ``A_it = G_it - sum_g(G_jt W_jt) / (sum_g W_jt + eps)``.

    ``W_it = sum_{s <= t} (1 - 2 pi_is + sum_v pi_is(v)^2)`` over valid tokens is
    the squared norm of the path's score function, making the baseline variance-minimising
    per token (verl's ``optimal_token_baseline``; OPO, arXiv 2505.23585). ``pi_is`` =
    ``exp(old_logprobs)``. A row alone at a position has baseline 0 there."""
    _check(token_level_rewards, response_mask, group)
    for name, t in (("old_logprobs", old_logprobs), ("sum_pi_squared", sum_pi_squared)):
        if t is None or t.shape != token_level_rewards.shape:
            raise ValueError(f"optimal_token_baseline needs {name} [B, T] from the trainer")
    returns, m = _reward_to_go(token_level_rewards, response_mask)
    pi = torch.exp(torch.where(m, old_logprobs.to(torch.float64), 0.0))
    w = torch.where(m, 1.0 - 2.0 * pi + sum_pi_squared.to(torch.float64), 0.0)
    w_cum = torch.where(m, w.cumsum(-1), 0.0)
    inverse, num_groups = _group_index(group)
    width = returns.shape[1]
    zeros = returns.new_zeros(num_groups, width)
    index = inverse[:, None].expand(-1, width)
    numerator = zeros.scatter_add(0, index, returns * w_cum)[inverse]
    denominator = zeros.scatter_add(0, index, w_cum)[inverse]
    running = zeros.scatter_add(0, index, m.to(torch.float64))[inverse]
    # a row alone at a position keeps its reward-to-go (verl differs with holes: docs/algorithms.md)
    baseline = torch.where(running > 1, numerator / (denominator + eps), 0.0)
    adv = torch.where(m, returns - baseline, 0.0)
    dtype = token_level_rewards.dtype
    return adv.to(dtype), torch.where(m, returns, 0.0).to(dtype)
