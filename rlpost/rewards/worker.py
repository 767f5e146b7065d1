"""The reward worker: scores group records, behind the same narrow interface as the others.

It takes :class:`~rlpost.types.Group` records from the rollout stage and
returns them with ``scores``, ``components`` and ``invalid`` filled in. Reward
models and judges hold weights or HTTP clients, so this worker is where they
live; the loop sees only records.
"""

from __future__ import annotations

from dataclasses import replace

from rlpost.rewards.scorer import RewardScorer, verifiable_accuracy
from rlpost.types import Group, RewardSample


def reward_samples(groups: list[Group], max_tokens: int) -> list[RewardSample]:
    """One :class:`RewardSample` per completion, groups in order."""
    return [
        RewardSample(
            prompt=g.prompt.text,
            # An episode is judged on the policy's final turn, not on the tools' output.
            completion=c.episode.answer if c.episode is not None else c.text,
            answer=g.prompt.answer,
            metadata=g.prompt.metadata,
            finish_reason=c.finish_reason,
            num_tokens=len(c.token_ids),
            max_tokens=max_tokens,
            source=g.prompt.source,
            episode=c.episode,
        )
        for g in groups
        for c in g.completions
    ]


class RewardWorker:
    """Scores groups with one :class:`RewardScorer` (every configured reward term)."""

    def __init__(self, scorer: RewardScorer, *, max_tokens: int) -> None:
        self.scorer = scorer
        self.max_tokens = max_tokens

    def score(
        self, groups: list[Group], max_tokens: int | None = None, *, training: bool = True
    ) -> list[Group]:
        """The groups with scores, components and invalid flags (new records; inputs untouched).

        ``training=False`` (evaluation) leaves out the training-only score overrides
        (``rollout.truncated_reward``), so held-out accuracy judges the answer itself.
        """
        samples = reward_samples(groups, max_tokens or self.max_tokens)
        scored = self.scorer.score(samples, training=training)
        bad = set(scored.invalid_rows)
        out, lo = [], 0
        for g in groups:
            rows = range(lo, lo + g.n)
            out.append(
                replace(
                    g,
                    scores=[scored.scores[r] for r in rows],
                    components={k: [v[r] for r in rows] for k, v in scored.components.items()},
                    invalid=[r in bad for r in rows],
                )
            )
            lo += g.n
        return out

    def verifiable_accuracy(self, groups: list[Group]) -> float | None:
        """Mean of the verifiable-kind components over the groups (NaNs skipped; None if none)."""
        return verifiable_accuracy(self.scorer.terms, (g.components for g in groups))

    def counters(self) -> dict[str, int]:
        return self.scorer.counters()

    def close(self) -> None:
        self.scorer.close()
