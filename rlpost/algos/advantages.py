"""Advantage estimators, registered by name, all with one signature.

``fn(token_level_rewards [B, T], response_mask [B, T], group [B], *, values=None,
**params) -> (advantages [B, T], returns [B, T])``, run without gradients.

``group`` holds int64 prompt ids in any order (verl's ``index``). Outcome estimators use the
score ``s_i = sum_t token_level_rewards[i, t]`` (:func:`scores_to_token_rewards`). Semantics
follow verl 0.9.1: unbiased std, ``eps`` added to the std, a singleton group keeps its raw
score. Group statistics are float64 around each group's minimum, so equal scores give exactly
zero. Outputs are zero on padding, in the dtype of ``token_level_rewards``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from rlpost.algos.aggregate import masked_whiten
from rlpost.registry import Registry

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]
ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")
# The keywords the train stage supplies when a trait asks; the others are ``rlpost.params``'.
CALLER_INPUTS = frozenset(
    {"values", "components", "baseline_scores", "old_logprobs", "sum_pi_squared"}
    | {"teacher_logprobs"}
)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; raises ``UnknownNameError`` listing valid names."""
    return ADVANTAGES.get(name)


def _check(token_level_rewards: Tensor, response_mask: Tensor, group: Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    if group.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group must be [B]={token_level_rewards.shape[0]}, got {tuple(group.shape)}"
        )
    if group.dtype.is_floating_point or group.dtype == torch.bool:
        raise ValueError(f"group must hold integer prompt ids, got dtype {group.dtype}")


def _group_index(group: Tensor) -> tuple[Tensor, int]:
    """``(inverse [B], G)``: each row's group as an index in ``[0, G)``, and the group count."""
    _, inverse = torch.unique(group, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_centered(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(centered [B], std [B], count [B])`` of ``scores [B]`` (float64) per ``group [B]``,
    broadcast back to rows; a singleton group gets mean 0 and std 1 (verl)."""
    inverse, num_groups = _group_index(group)
    zeros = scores.new_zeros(num_groups)
    count = zeros.scatter_add(0, inverse, torch.ones_like(scores))
    # Centre around the group minimum: equal scores give exact zeros after shifting.
    pivot = zeros.scatter_reduce(0, inverse, scores, reduce="amin", include_self=False)
    shifted = scores - pivot[inverse]
    mean_shift = zeros.scatter_add(0, inverse, shifted) / count
    centered = shifted - mean_shift[inverse]
    var = zeros.scatter_add(0, inverse, centered**2) / (count - 1).clamp(min=1.0)
    row_count = count[inverse]
    singleton = row_count == 1
    centered = torch.where(singleton, scores, centered)
    std = torch.where(singleton, torch.ones_like(scores), var.sqrt()[inverse])
    return centered, std, row_count


def _outcome_scores(token_level_rewards: Tensor) -> Tensor:
    return token_level_rewards.to(torch.float64).sum(-1)


def _tile(
    row_values: Tensor, response_mask: Tensor, dtype: torch.dtype, whiten: bool = False
) -> tuple[Tensor, Tensor]:
    """(advantages, returns): ``row_values [B]`` over ``[B, T]``, zero on padding, whitened
    over the batch's valid tokens where ``whiten``; returns are a copy."""
    m = response_mask.to(torch.float64) > 0
    tiled = torch.where(m, row_values[:, None], 0.0)
    advantages = (masked_whiten(tiled, m) if whiten else tiled).to(dtype)
    return advantages, advantages.clone()


_HEAD = [
    inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Tensor")
    for n in ("token_level_rewards", "response_mask", "group")
] + [inspect.Parameter("values", inspect.Parameter.KEYWORD_ONLY, default=None)]


def outcome(name: str, *, whiten: bool = False, **traits):
    """Register ``fn(scores [B], group [B], **params) -> [B]`` (float64 summed rewards in,
    tiled by :func:`_tile`) as the outcome estimator ``name``."""

    def wrap(fn: Callable[..., Tensor]) -> AdvantageEstimator:
        @functools.wraps(fn)
        @torch.no_grad()
        def estimator(token_level_rewards, response_mask, group, *, values=None, **params):
            _check(token_level_rewards, response_mask, group)
            rows = fn(_outcome_scores(token_level_rewards), group, **params)
            return _tile(rows, response_mask, token_level_rewards.dtype, whiten=whiten)

        own = inspect.signature(fn).parameters.values()
        kept = [p for p in own if p.kind is p.KEYWORD_ONLY]
        estimator.__signature__ = inspect.Signature([*_HEAD, *kept])
        return ADVANTAGES.register(name, **traits)(estimator)

    return wrap


def _reward_to_go(token_level_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(G [B, T], valid [B, T])``: the undiscounted float64 reward-to-go over valid tokens."""
    m = response_mask.to(torch.float64) > 0
    rewards = torch.where(m, token_level_rewards.to(torch.float64), 0.0)
    return rewards.flip(-1).cumsum(-1).flip(-1), m


@outcome("grpo", group_relative=True)
def grpo_advantages(
    scores: Tensor,
    group: Tensor,
    *,
    norm_by_std: bool = True,
    std_scope: str = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO ``A_i = (s_i - mean_g) / (std_g + eps)`` (DeepSeekMath, arXiv 2402.03300);
    ``std_scope="batch"``: the batch's std (TRL's ``scale_rewards="batch"``, arXiv 2508.08221)."""
    if std_scope not in ("group", "batch"):
        raise ValueError(f"grpo std_scope must be 'group' or 'batch', got {std_scope!r}")
    centered, std, _ = _group_centered(scores, group)
    if std_scope == "batch" and scores.numel() > 1:
        std = torch.full_like(std, float((scores - scores.min()).std()))
    return centered / (std + eps) if norm_by_std else centered


@outcome("dr_grpo", group_relative=True)
def dr_grpo_advantages(scores: Tensor, group: Tensor) -> Tensor:
    """Dr.GRPO ``A_i = s_i - mean_g`` (arXiv 2503.20783); pair with ``seq-mean-token-sum-norm``."""
    return _group_centered(scores, group)[0]


@outcome("rloo", group_relative=True)
def rloo_advantages(scores: Tensor, group: Tensor) -> Tensor:
    """RLOO ``A_i = s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_g)`` (arXiv 2402.14740)."""
    centered, _, count = _group_centered(scores, group)
    return torch.where(count > 1, centered * count / (count - 1).clamp(min=1.0), centered)


@outcome("gpg", group_relative=True)
def gpg_advantages(scores: Tensor, group: Tensor) -> Tensor:
    """GPG ``A_i = alpha (s_i - mean_g)``, ``alpha = B / max(1, #{s_i != 0})`` (arXiv
    2504.02546)."""
    alpha = scores.numel() / max(1, int((scores != 0).sum()))
    return alpha * _group_centered(scores, group)[0]


@ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu, arXiv 2501.03262): discounted return, then batch-global whitening.

    ``G_t = r_t + gamma G_{t+1}`` over valid tokens (mask-0 tokens carry G undiscounted,
    verl); advantages ``= whiten(G)`` over the batch's valid tokens; returns are ``G``."""
    _check(token_level_rewards, response_mask, group)
    m = response_mask.to(torch.float64) > 0
    rewards = token_level_rewards.to(torch.float64)
    running = rewards.new_zeros(rewards.shape[0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        candidate = rewards[:, t] + gamma * running
        running = torch.where(m[:, t], candidate, running)
        returns[:, t] = torch.where(m[:, t], candidate, torch.zeros_like(candidate))
    advantages = masked_whiten(returns, m)
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


@outcome("reinforce_pp_baseline", whiten=True, group_relative=True)
def reinforce_pp_baseline_advantages(scores: Tensor, group: Tensor) -> Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): ``s_i - mean_g`` tiled, then global whitening."""
    return _group_centered(scores, group)[0]


def _gae(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lam: Tensor) -> Tensor:
    """GAE ``[B, T]`` with per-row ``lam [B]``, float64: ``A_t = delta_t + gamma lam A_next``,
    ``V_next`` and ``A_next`` advancing only on valid tokens (verl)."""
    next_value = rewards.new_zeros(rewards.shape[0])
    next_adv = rewards.new_zeros(rewards.shape[0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        out[:, t] = next_adv
    return out


def _critic_inputs(
    name: str, token_level_rewards: Tensor, response_mask: Tensor, values: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    if values is None:
        raise ValueError(f"advantage estimator {name!r} needs values [B, T] from the critic")
    if values.shape != token_level_rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != rewards shape {tuple(token_level_rewards.shape)}"
        )
    valid = response_mask.to(torch.float64) > 0
    # Zero the padding so garbage there cannot reach the float64 recursion as inf.
    rewards = torch.where(valid, token_level_rewards.to(torch.float64), 0.0)
    v = torch.where(valid, values.to(torch.float64), 0.0)
    return rewards, v, valid


@ADVANTAGES.register("gae", needs_critic=True)
@torch.no_grad()
def gae_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """PPO's GAE (arXiv 1506.02438): advantages ``whiten(A)``, returns ``A + V``."""
    _check(token_level_rewards, response_mask, group)
    rewards, v, valid = _critic_inputs("gae", token_level_rewards, response_mask, values)
    lam_rows = rewards.new_full((rewards.shape[0],), float(lam))
    adv = _gae(rewards, v, valid, gamma, lam_rows)
    dtype = token_level_rewards.dtype
    returns = torch.where(valid, adv + v, 0.0).to(dtype)
    return masked_whiten(adv, valid).to(dtype), returns


@ADVANTAGES.register("vapo_gae", needs_critic=True)
@torch.no_grad()
def vapo_gae_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    alpha: float = 0.05,
    value_lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """VAPO's length-adaptive GAE (arXiv 2504.05118): ``lam_i = 1 - 1 / (alpha n_i)`` for
    ``n_i`` valid tokens, clamped to [0, 1]; ``returns = A(value_lam) + V``."""
    _check(token_level_rewards, response_mask, group)
    if alpha <= 0:
        raise ValueError(f"vapo_gae alpha must be > 0, got {alpha}")
    rewards, v, valid = _critic_inputs("vapo_gae", token_level_rewards, response_mask, values)
    lengths = valid.to(torch.float64).sum(-1).clamp(min=1.0)
    policy_lam = (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)
    policy_adv = _gae(rewards, v, valid, gamma, policy_lam)
    critic_adv = _gae(rewards, v, valid, gamma, rewards.new_full(lengths.shape, float(value_lam)))
    dtype = token_level_rewards.dtype
    returns = torch.where(valid, critic_adv + v, 0.0).to(dtype)
    return masked_whiten(policy_adv, valid).to(dtype), returns


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """``scores [B]`` on each row's last valid token, ``[B, T]``; a row without one keeps its
    score at position 0, so it still counts in its group (verl, TRL)."""
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(f"scores must be [B]={response_mask.shape[0]}, got {tuple(scores.shape)}")
    m = response_mask.to(torch.float64) > 0
    positions = torch.arange(1, m.shape[1] + 1, device=m.device)
    last = (positions * m).argmax(-1)  # 0 for a row with no valid token
    columns = torch.arange(m.shape[1], device=m.device)[None, :]
    is_last = (columns == last[:, None]) & (m | ~m.any(-1, keepdim=True))
    return torch.where(is_last, scores[:, None], 0.0)
