"""The KL coefficient: its one owner, deciding where the KL applies and how beta moves.

``beta`` is read and written only here. Its placement is decided once: subtracted from
the per-token reward (``in_reward``: PPO, REINFORCE++; Ziegler et al., arXiv 1909.08593)
or added to the loss (``in_loss``: GRPO); the other reads 0. With a ``target`` KL the
coefficient follows Ziegler et al.'s proportional controller after every step
(:meth:`observe`); a guard raises it through :meth:`raise_by`. The whole state is beta,
so a checkpoint stores ``state_dict()`` and a resumed run continues with the same value.
"""

from __future__ import annotations

# Ziegler et al. clip the proportional error so one noisy KL reading moves beta
# by at most 20% of n_steps / horizon.
ADAPTIVE_ERROR_CLIP = 0.2
# What a guard's raise sets when beta is 0 (there is nothing to multiply).
RAISED_FROM_ZERO = 0.01


class KLCoefficient:
    """``beta`` at ``placement`` (``loss`` or ``reward``); steered toward ``target`` when set.

    The controller: ``err = clip(kl / target - 1, -0.2, 0.2)``; ``beta *= 1 + err *
    n_steps / horizon``, ``n_steps`` the number of samples behind the KL reading (the
    batch size) and ``horizon`` how many samples a full 20% correction takes.
    """

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
