"""Advantage estimators that need more than rewards and groups, or change the group baseline.

Same signature and conventions as ``advantages.py`` (float64 inside, zero on
padding, dtype of ``token_level_rewards`` out). Some take a caller-supplied
input, announced by a registry trait so the train stage knows to provide it:

- ``needs_components``: ``components [B, K]``, each reward term's value per row (GDPO);
- ``needs_greedy_baseline``: ``baseline_scores [B]``, the reward of a greedy
  response to each row's prompt (ReMax);
- ``needs_sum_pi_squared``: ``sum_pi_squared [B, T]`` (``sum_v pi(v)^2`` at each
  position) and ``old_logprobs [B, T]`` of the sampling policy (optimal token baseline).

Inputs not needed by an estimator are accepted by none of the others, so a
config that sets them is refused by signature at load.
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

    ``n_j`` = valid tokens of row j. On-Policy RL with Optimal reward baseline
    (Hao et al., arXiv 2505.23585): with exact on-policy updates, the
    variance-minimising sequence baseline weights each return by the squared
    gradient norm, which the paper approximates by the length. A singleton group,
    or one whose rows have no valid token, gets baseline 0 (verl).
    Shapes: rewards, mask ``[B, T]``, group ``[B]`` -> ``([B, T], [B, T])``.
    """
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

    Every other row gets 0, so the update raises the probability of the best
    response only by its margin over the runner-up: the leave-one-out gradient
    of the pass@n objective ("Optimizing Language Models for Inference Time
    Objectives using Reinforcement Learning", Tang et al., arXiv 2503.19595;
    verl's ``grpo_passk``). Ties go to the first row in batch order;
    with a tie for best the margin is 0. Needs groups of at least 2 rows.
    """
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

    ``A_i = whiten_batch(sum_k (c_ik - mean_g c_k) / (std_g c_k + eps))``, so a
    term with a large scale cannot drown the others' signal in a multi-term
    reward (GDPO: Group reward-Decoupled Normalization Policy Optimization, Liu et
    al., arXiv 2601.05242; verl's ``gdpo``). ``components [B, K]``: each term's value per row; NaN (the
    term did not apply) counts as 0. Without components the summed score is the
    only term (GRPO followed by batch whitening). Whitening as ``masked_whiten``
    over valid tokens.
    """
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
    """ReMax: ``A_it = G_it - b_i`` with ``b_i`` the reward of the greedy response to the prompt.

    ``G_it`` is the undiscounted reward-to-go over valid tokens (the outcome score
    on every token for an outcome reward). ReMax, Li et al., arXiv 2310.10505.
    ``baseline_scores [B]``: the greedy response's reward for each row's prompt
    (the rollout stage samples it). No normalisation, as the paper and verl.
    Shapes: rewards, mask ``[B, T]`` -> ``(advantages, returns)`` ``[B, T]``.
    """
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
    the squared norm of the score function of the path so far (``||e_y - pi||^2``
    for a softmax policy), so the baseline at position t is the variance-minimising
    one among the group's rows still running there (verl's
    ``optimal_token_baseline``; the optimal-baseline argument of OPO, arXiv
    2505.23585, per token). ``G_it`` is the reward-to-go. ``pi_is`` =
    ``exp(old_logprobs)``; ``sum_pi_squared [B, T]`` from the trainer's forward pass.
    A row alone at a position has baseline 0 there (its advantage is its reward-to-go);
    verl's rule, except with holes inside a mask (docs/algorithms.md).
    Shapes: ``[B, T]`` tensors, group ``[B]`` -> ``(advantages, returns)`` ``[B, T]``.
    """
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
    # a row alone at a position has no baseline there, so its reward-to-go is its advantage;
    # verl zeroes the unique longest row past the second-longest row's token count, the same
    # positions when padding is at the end, not with holes in a mask (docs/algorithms.md)
    baseline = torch.where(running > 1, numerator / (denominator + eps), 0.0)
    adv = torch.where(m, returns - baseline, 0.0)
    dtype = token_level_rewards.dtype
    return adv.to(dtype), torch.where(m, returns, 0.0).to(dtype)
