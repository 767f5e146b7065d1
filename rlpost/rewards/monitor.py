"""Reward-hacking monitor: flags steps where the reward and the truth drift apart.

A rising reward with flat accuracy, or a ballooning length (Gao et al., 2023; Singhal et al.,
2023), shows in step means before the eval curve turns; each is compared between the older
and newer half of a sliding window.
"""

from __future__ import annotations

import math
from collections import Counter, deque

REWARD_UP_ACCURACY_FLAT = "reward_up_accuracy_flat"
LENGTH_BALLOON = "length_balloon"


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class HackingMonitor:
    """Feed one line of step means per step; get back the flags raised at that step
    (``reward_up_accuracy_flat``, ``length_balloon``)."""

    def __init__(
        self,
        window: int = 20,
        reward_rise: float = 0.2,
        accuracy_band: float = 0.02,
        length_factor: float = 1.5,
    ) -> None:
        if window < 2:
            raise ValueError(f"HackingMonitor: window must be >= 2, got {window}")
        if length_factor <= 1.0:
            raise ValueError(f"HackingMonitor: length_factor must be > 1, got {length_factor}")
        self.window = window
        self.reward_rise = reward_rise
        self.accuracy_band = accuracy_band
        self.length_factor = length_factor
        self._rows: deque[tuple[float | None, float | None, float | None]] = deque(maxlen=window)
        self.counts: Counter[str] = Counter()

    def _halves(self, column: int) -> tuple[float | None, float | None]:
        values = [row[column] for row in self._rows]
        half = len(values) // 2
        return _mean(values[:half]), _mean(values[-half:])

    def update(
        self,
        reward_mean: float,
        verifiable_accuracy: float | None,
        response_length_mean: float,
    ) -> list[str]:
        """Record one step and return the flags raised now (``verifiable_accuracy=None``
        skips the reward/accuracy check)."""
        self._rows.append(
            (_finite(reward_mean), _finite(verifiable_accuracy), _finite(response_length_mean))
        )
        if len(self._rows) < self.window:
            return []
        flags = []
        reward_old, reward_new = self._halves(0)
        acc_old, acc_new = self._halves(1)
        if None not in (reward_old, reward_new, acc_old, acc_new):
            rose = reward_new - reward_old > self.reward_rise
            if rose and acc_new - acc_old <= self.accuracy_band:
                flags.append(REWARD_UP_ACCURACY_FLAT)
        len_old, len_new = self._halves(2)
        if len_old is not None and len_new is not None and len_old > 0:
            if len_new / len_old > self.length_factor:
                flags.append(LENGTH_BALLOON)
        self.counts.update(flags)
        return flags
