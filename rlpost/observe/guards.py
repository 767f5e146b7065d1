"""Guards: decide what to do when training starts to go wrong.

Pure decisions over numbers the loop has (no torch); the loop carries out the returned
:class:`Action`s and counts each. Every remedy has a budget (``max_retries``) and escalates
when it is spent: soft remedies to a rollback, rollbacks and rebuilds to ``stop``. Reward
collapse compares the reward EMA with the best seen, armed after ``reward_collapse_window``
steps, and needs a fall both relative and absolute; throughput decay compares medians over
``throughput_window`` steps.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from rlpost.config import GuardConfig

logger = logging.getLogger(__name__)

ActionKind = Literal[
    "skip_update", "drop_samples", "raise_beta", "lower_lr", "rollback", "rebuild_engine", "stop"
]

NONFINITE_UPDATE = "nonfinite_update"
NONFINITE_REWARD = "nonfinite_reward"
KL_EXPLOSION = "kl_explosion"
CLIP_FRAC = "clip_frac"
REWARD_COLLAPSE = "reward_collapse"
THROUGHPUT_DECAY = "throughput_decay"


@dataclass(frozen=True)
class Action:
    """One thing the training loop must do; ``factor`` scales beta or the LR."""

    guard: str
    kind: ActionKind
    factor: float | None
    reason: str


def _finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class Guards:
    """Stateful guard rules for one run; see the module docstring for the rules."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.stopped = False
        self._step = 0
        self._bad_updates = 0
        self._rollbacks = 0
        self._rebuilds = 0
        self._soft_uses: dict[str, int] = {}
        self._quiet_until: dict[str, int] = {}
        self._reset_reward()
        self._tps: deque[float] = deque(maxlen=cfg.throughput_window)
        self._best_tps = 0.0

    def _reset_reward(self) -> None:
        self._reward_ema: float | None = None
        self._best_ema = -math.inf
        self._reward_steps = 0

    def _act(self, guard: str, kind: ActionKind, factor: float | None, reason: str) -> Action:
        action = Action(guard, kind, factor, reason)
        log = logger.error if kind == "stop" else logger.warning
        log("guard %s: %s%s - %s", guard, kind, f" x{factor:g}" if factor else "", reason)
        return action

    def _stop(self, guard: str, reason: str) -> Action:
        self.stopped = True
        return self._act(guard, "stop", None, reason)

    def _rollback(self, guard: str, reason: str, *, lower_lr: bool = True) -> list[Action]:
        """Roll back (and lower the LR), or stop when the rollback budget is spent."""
        if self._rollbacks >= self.cfg.max_retries:
            spent = f"{self._rollbacks} rollbacks did not help"
            knob = f"observe.guards.max_retries={self.cfg.max_retries}"
            return [self._stop(guard, f"{reason}; {spent} ({knob})")]
        self._rollbacks += 1
        self._reset_reward()
        budget = f"rollback {self._rollbacks}/{self.cfg.max_retries}"
        actions = [self._act(guard, "rollback", None, f"{reason}; {budget}")]
        if lower_lr:
            gentler = "retry from the restored weights with a smaller step"
            actions.append(self._act(guard, "lower_lr", self.cfg.lr_factor, gentler))
        return actions

    def check_update(self, loss: float, grad_norm: float) -> Action | None:
        """``skip_update`` for a non-finite loss or grad norm; past ``max_retries`` in a row,
        ``rollback`` (or ``stop``)."""
        if not self.cfg.enabled:
            return None
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._bad_updates = 0
            return None
        self._bad_updates += 1
        reason = f"loss={loss} grad_norm={grad_norm}"
        if self._bad_updates > self.cfg.max_retries:
            self._bad_updates = 0
            in_a_row = f"{reason}, {self.cfg.max_retries + 1} in a row"
            return self._rollback(NONFINITE_UPDATE, in_a_row, lower_lr=False)[0]
        return self._act(NONFINITE_UPDATE, "skip_update", None, reason)

    def check_rewards(self, scores: list[float]) -> list[int]:
        """Indices of non-finite scores, to drop before computing advantages."""
        if not self.cfg.enabled:
            return []
        bad = [i for i, score in enumerate(scores) if not math.isfinite(score)]
        if bad:
            self._act(NONFINITE_REWARD, "drop_samples", None, f"{len(bad)}/{len(scores)} scores")
        return bad

    def after_step(self, metrics: dict[str, float]) -> list[Action]:
        """Actions after a step, from its finite metrics; after a ``stop``, the stop again."""
        if not self.cfg.enabled:
            return []
        if self.stopped:
            return [Action("stopped", "stop", None, "training was already stopped by a guard")]
        self._step += 1
        actions: list[Action] = []
        actions += self._check_kl(_finite(metrics, "kl"))
        actions += self._check_clip(_finite(metrics, "clip_frac"))
        if not any(a.kind in ("rollback", "stop") for a in actions):
            actions += self._check_reward(_finite(metrics, "reward_mean"))
        actions += self._check_throughput(_finite(metrics, "rollout_tps"))
        if any(a.kind == "stop" for a in actions):
            return [a for a in actions if a.kind == "stop"][:1]
        return actions

    def _soft(self, guard: str, kind: ActionKind, factor: float, reason: str) -> list[Action]:
        """A soft remedy with a cooldown; past its budget it becomes a rollback."""
        if self._step < self._quiet_until.get(guard, 0):
            return []
        self._quiet_until[guard] = self._step + self.cfg.cooldown + 1
        uses = self._soft_uses.get(guard, 0)
        if uses >= self.cfg.max_retries:
            self._soft_uses[guard] = 0
            return self._rollback(guard, f"{reason}, still after {uses} x {kind}")
        self._soft_uses[guard] = uses + 1
        return [self._act(guard, kind, factor, reason)]

    def _check_kl(self, kl: float | None) -> list[Action]:
        if kl is None or kl <= self.cfg.kl_ceiling:
            return []
        reason = f"kl={kl:.3g} nats/token > kl_ceiling={self.cfg.kl_ceiling:g}"
        return self._soft(KL_EXPLOSION, "raise_beta", self.cfg.kl_beta_factor, reason)

    def _check_clip(self, clip_frac: float | None) -> list[Action]:
        if clip_frac is None or clip_frac <= self.cfg.clip_frac_ceiling:
            return []
        reason = f"clip_frac={clip_frac:.3g} > clip_frac_ceiling={self.cfg.clip_frac_ceiling:g}"
        return self._soft(CLIP_FRAC, "lower_lr", self.cfg.lr_factor, reason)

    def _check_reward(self, reward: float | None) -> list[Action]:
        if reward is None:
            return []
        alpha = 2.0 / (self.cfg.reward_collapse_window + 1)
        last = self._reward_ema
        ema = self._reward_ema = reward if last is None else last + alpha * (reward - last)
        self._reward_steps += 1
        if self._reward_steps < self.cfg.reward_collapse_window:
            return []
        best = self._best_ema = max(self._best_ema, ema)
        fall = best - ema
        needed = max(self.cfg.reward_collapse_drop * abs(best), self.cfg.reward_collapse_min_drop)
        if fall < needed or fall <= 0:
            return []
        reason = (
            f"reward EMA {ema:.3g} fell {fall:.3g} from its best {best:.3g} (limit {needed:.3g})"
        )
        return self._rollback(REWARD_COLLAPSE, reason)

    def _check_throughput(self, tps: float | None) -> list[Action]:
        if tps is None:
            return []
        self._tps.append(tps)
        if len(self._tps) < self.cfg.throughput_window:
            return []
        median = statistics.median(self._tps)
        self._best_tps = max(self._best_tps, median)
        if median >= self.cfg.throughput_decay * self._best_tps:
            self._rebuilds = 0  # recovered: only consecutive failed rebuilds end the run
            return []
        reason = f"rollout median {median:.3g} tokens/s < {self.cfg.throughput_decay:g} x best {self._best_tps:.3g}"
        self._tps.clear()
        if self._rebuilds >= self.cfg.max_retries:
            # slow rollout corrupts nothing: past the rebuild budget, only a warning
            spent = "guard %s: %s; %d rebuilds spent, continuing"
            logger.warning(spent, THROUGHPUT_DECAY, reason, self._rebuilds)
            return []
        self._rebuilds += 1
        budget = f"{reason}; rebuild {self._rebuilds}/{self.cfg.max_retries}"
        return [self._act(THROUGHPUT_DECAY, "rebuild_engine", None, budget)]
