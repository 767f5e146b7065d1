"""A run that cannot learn says so, in one line, at its first steps.

Warned once each: ``truncated_frac`` above 0.9; zero reward spread in every group at each of
the first steps; the engine's served checksum (``RolloutWorker.served_checksum``) unchanged
after the trainer's weights changed.
"""

from __future__ import annotations

import logging

from rlpost.rollout.worker import weights_checksum

log = logging.getLogger(__name__)

TRUNCATED_FRAC = 0.9  # above this share of truncated responses the reward is mostly the cap's
FIRST_STEPS = 3  # the steps checked; in overlapped modes the engine may take weights a step late


class LearnabilityCheck:
    """Warnings for runs that cannot learn; ``messages`` keeps what was said."""

    def __init__(self, *, max_tokens: int, truncated_reward, group_relative: bool) -> None:
        self.max_tokens = max_tokens
        self.truncated_reward = truncated_reward
        self.group_relative = group_relative
        self.messages: list[str] = []
        self._start: tuple[int | None, int] | None = None  # (engine, trainer) checksums
        self._engine_checked = False
        self._flat_steps = 0

    def _warn(self, message: str) -> None:
        if message.split(":", 2)[1] not in {m.split(":", 2)[1] for m in self.messages}:
            self.messages.append(message)
            log.warning(message)

    def start(self, workers) -> None:
        """Record the checksums the run starts from (after its first sync)."""
        self._start = (workers.rollout.served_checksum(), _trainer_checksum(workers))

    def after_step(self, step: int, metrics: dict, workers) -> None:
        """Check step ``step`` (from 1): its metrics, and the engine after its sync."""
        if step > FIRST_STEPS:
            return
        truncated = metrics.get("truncated_frac", 0.0)
        if truncated > TRUNCATED_FRAC:
            cap = self.truncated_reward
            score = "scored as usual" if cap is None else f"scored {cap:g}"
            self._warn(
                f"cannot learn: truncated responses: truncated_frac={truncated:.2f} at step "
                f"{step}, nearly every response hits rollout.max_tokens={self.max_tokens} and "
                f"is {score}; raise rollout.max_tokens"
            )
        flat = self.group_relative and metrics.get("zero_spread_frac", 0.0) >= 1.0
        self._flat_steps = self._flat_steps + 1 if flat else 0
        if self._flat_steps == FIRST_STEPS:  # a cold start's first batch may be flat alone
            self._warn(
                f"cannot learn: no reward spread: every group's rewards were equal in each of "
                f"steps 1-{step}, so every group-relative advantage is 0; check the reward on "
                "a few samples (reward.sample_every) or make the task reachable"
            )
        self._check_engine(step, workers)

    def _check_engine(self, step: int, workers) -> None:
        if self._engine_checked or self._start is None or self._start[0] is None:
            return
        if _trainer_checksum(workers) == self._start[1]:
            return  # the policy has not changed yet (a critic warm-up)
        version = workers.rollout.version()
        if workers.rollout.served_checksum() != self._start[0]:
            self._engine_checked = True
        elif version >= 1 or step >= FIRST_STEPS:
            self._engine_checked = True
            self._warn(
                f"cannot learn: stale engine: at step {step} the engine (version {version}) "
                "still serves the initial weights though the trainer's have changed; the "
                "weight push does not reach it"
            )


def _trainer_checksum(workers) -> int:
    return weights_checksum(workers.trainer.export_weights().tensors)
