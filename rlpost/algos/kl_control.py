"""KL coefficient controllers for a KL penalty in the reward (Ziegler et al., arXiv 1909.08593).

Plain Python objects whose whole state is one float, so a checkpoint stores
``state_dict()`` and a resumed run continues with the same coefficient.
"""

from __future__ import annotations

# Ziegler et al. clip the proportional error so one noisy KL reading moves beta
# by at most 20% of n_steps / horizon.
ADAPTIVE_ERROR_CLIP = 0.2


class FixedKLController:
    """A constant KL coefficient ``beta``."""

    def __init__(self, beta: float) -> None:
        if beta < 0:
            raise ValueError(f"KL beta must be >= 0, got {beta}")
        self.beta = float(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Return ``beta`` unchanged; the signature matches :class:`AdaptiveKLController`."""
        return self.beta

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.beta = float(state["beta"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL toward ``target``.

    ``err = clip(kl / target - 1, -0.2, 0.2)``; ``beta *= 1 + err * n_steps / horizon``
    (Ziegler et al. 2019). ``n_steps`` is the number of samples behind
    ``current_kl`` (the batch size), ``horizon`` how many samples a full 20%
    correction takes.
    """

    def __init__(self, init_beta: float, target: float, horizon: int) -> None:
        if init_beta < 0:
            raise ValueError(f"KL init_beta must be >= 0, got {init_beta}")
        if target <= 0:
            raise ValueError(f"KL target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"KL horizon must be > 0, got {horizon}")
        self.beta = float(init_beta)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move ``beta`` toward the target KL and return the new value."""
        err = min(max(current_kl / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.beta *= 1.0 + err * n_steps / self.horizon
        return self.beta

    # The saved state is beta alone, as the fixed controller's.
    state_dict = FixedKLController.state_dict
    load_state_dict = FixedKLController.load_state_dict
