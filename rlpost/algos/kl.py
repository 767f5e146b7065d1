"""Per-token KL estimators between the policy and the reference policy.

Every estimator is ``fn(logprobs [B, T], ref_logprobs [B, T]) -> [B, T]``, unmasked,
with ``x = logprobs - ref_logprobs`` on the sampled tokens (Schulman, "Approximating KL
Divergence", 2020), values as verl 0.9.1 ``kl_penalty``. The ``+`` variants take the
gradient of ``x^2/2``, the true KL gradient in expectation.

:class:`KLCoefficient` alone reads and writes ``beta``, placed once in the reward
(``in_reward``: PPO; Ziegler et al., arXiv 1909.08593) or the loss (``in_loss``: GRPO).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlpost.algos.aggregate import masked_mean
from rlpost.registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")

# verl's low_var_kl bounds: exp stays finite, one runaway token cannot dominate.
K3_EXPONENT_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape {tuple(ref_logprobs.shape)}"
        )
    return logprobs - ref_logprobs.detach()


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = x, x = logprobs - ref_logprobs; shapes ``[B, T] -> [B, T]`` (unbiased, high variance)."""
    return _log_ratio(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = x^2 / 2; shapes ``[B, T] -> [B, T]`` (biased, low variance)."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = e^y - y - 1, y = clamp(-x, -20, 20), clamped to [-10, 10] (verl's ``low_var_kl``)."""
    y = torch.clamp(-_log_ratio(logprobs, ref_logprobs), -K3_EXPONENT_CLAMP, K3_EXPONENT_CLAMP)
    return torch.clamp(torch.exp(y) - y - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|x|; shapes ``[B, T] -> [B, T]``."""
    return _log_ratio(logprobs, ref_logprobs).abs()


def _straight_through(value: Tensor, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Value of ``value``, gradient of ``x^2/2`` (verl's ``+`` suffix)."""
    surrogate = 0.5 * _log_ratio(logprobs, ref_logprobs) ** 2
    return surrogate - surrogate.detach() + value.detach()


@KL_ESTIMATORS.register("k1+")
def kl_k1_straight_through(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 value with the gradient of x^2/2 (= x per token); shapes ``[B, T] -> [B, T]``."""
    return _straight_through(kl_k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k3+")
def kl_k3_straight_through(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 value with the gradient of x^2/2 (= x per token); shapes ``[B, T] -> [B, T]``."""
    return _straight_through(kl_k3(logprobs, ref_logprobs), logprobs, ref_logprobs)


@KL_ESTIMATORS.register("abs+")
def kl_abs_straight_through(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|x| value with the gradient of x^2/2 (= x per token); shapes ``[B, T] -> [B, T]``."""
    return _straight_through(kl_abs(logprobs, ref_logprobs), logprobs, ref_logprobs)


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The estimator registered as ``name``; raises ``UnknownNameError`` listing valid names."""
    return KL_ESTIMATORS.get(name)


@torch.no_grad()
def kl_penalized_rewards(
    token_level_scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    beta: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL in the reward: ``r = scores - beta * kl(old, ref) * m`` (Ziegler et al. 2019, arXiv 1909.08593).

    Returns ``(token_level_rewards [B, T], mean_kl)`` as verl's ``apply_kl_penalty``."""
    kl = get_kl_estimator(estimator)(old_logprobs, ref_logprobs)
    kl = torch.where(response_mask.to(kl.dtype) > 0, kl, torch.zeros_like(kl))
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_level_scores - beta * kl, mean_kl


# Ziegler et al.'s clip: one noisy KL reading moves beta by at most 20% of n_steps / horizon.
ADAPTIVE_ERROR_CLIP = 0.2
# What a guard's raise sets when beta is 0 (there is nothing to multiply).
RAISED_FROM_ZERO = 0.01


class KLCoefficient:
    """``beta`` at ``placement`` (``loss`` or ``reward``); steered toward ``target`` when set.

    The controller: ``err = clip(kl / target - 1, -0.2, 0.2)``; ``beta *= 1 + err *
    n_steps / horizon``, ``n_steps`` the number of samples behind the KL reading (the
    batch size) and ``horizon`` how many samples a full 20% correction takes."""

    def __init__(
        self,
        beta: float,
        placement: str = "loss",
        target: float | None = None,
        horizon: int = 10000,
    ) -> None:
        if beta < 0:
            raise ValueError(f"KL beta must be >= 0, got {beta}")
        if target is not None and target <= 0:
            raise ValueError(f"KL target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"KL horizon must be > 0, got {horizon}")
        if placement not in ("loss", "reward"):
            raise ValueError(f"KL placement must be loss or reward, got {placement!r}")
        self._beta, self.placement = float(beta), placement
        self.target, self.horizon = target, int(horizon)

    @property
    def beta(self) -> float:
        return self._beta

    @property
    def in_reward(self) -> float:
        """The coefficient of the KL penalty in the reward (0 when it is in the loss)."""
        return self._beta if self.placement == "reward" else 0.0

    @property
    def in_loss(self) -> float:
        """The coefficient of the KL term in the loss (0 when it is in the reward)."""
        return self._beta if self.placement == "loss" else 0.0

    def observe(self, current_kl: float, n_steps: int) -> float:
        """The step's measured KL moves beta toward the target (none: beta stays); returns beta."""
        if self.target is not None:
            err = current_kl / self.target - 1.0
            err = min(max(err, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
            self._beta *= 1.0 + err * n_steps / self.horizon
        return self._beta

    def raise_by(self, factor: float) -> float:
        """A guard's remedy: beta times ``factor`` (from 0: ``RAISED_FROM_ZERO``); returns beta."""
        self._beta = self._beta * factor if self._beta > 0 else RAISED_FROM_ZERO
        return self._beta

    def state_dict(self) -> dict[str, float]:
        return {"beta": self._beta}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._beta = float(state["beta"])
