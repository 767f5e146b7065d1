"""Rewards routed by data source: each source's prompts scored by its own reward terms.

A source with its own ``reward`` gets its own :class:`~rlpost.rewards.scorer.RewardScorer`;
a term that did not score a sample has ``nan`` there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlpost.config import RewardConfig, SourceConfig
from rlpost.rewards.scorer import RewardScorer, Term, build_scorer
from rlpost.types import RewardSample, ScoredBatch


class RoutedScorer:
    """Scores each sample with the scorer of its source (``default`` for the rest)."""

    def __init__(self, default: RewardScorer, by_source: dict[str, RewardScorer]) -> None:
        self.default = default
        self.by_source = by_source

    @property
    def terms(self) -> list[Term]:
        """Every scorer's terms, each name once (the verifiable-accuracy signal reads them)."""
        out: dict[str, Term] = {}
        for scorer in (self.default, *self.by_source.values()):
            for t in scorer.terms:
                out.setdefault(t.name, t)
        return list(out.values())

    def score(self, samples: Sequence[RewardSample], *, training: bool = True) -> ScoredBatch:
        parts: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            parts.setdefault(s.source if s.source in self.by_source else "", []).append(i)
        scores = [0.0] * len(samples)
        components: dict[str, list[float]] = {}
        invalid_rows: list[int] = []
        for source, rows in parts.items():
            scorer = self.by_source.get(source, self.default)
            got = scorer.score([samples[i] for i in rows], training=training)
            for j, i in enumerate(rows):
                scores[i] = got.scores[j]
            for name, column in got.components.items():
                out = components.setdefault(name, [math.nan] * len(samples))
                for j, i in enumerate(rows):
                    out[i] = column[j]
            invalid_rows += [rows[j] for j in got.invalid_rows]
        return ScoredBatch(scores, components, len(invalid_rows), sorted(invalid_rows))

    def counters(self) -> dict[str, int]:
        """The default scorer's counters, and each source scorer's as ``source:counter``."""
        out = dict(self.default.counters())
        for source, scorer in self.by_source.items():
            out.update({f"{source}:{k}": v for k, v in scorer.counters().items()})
        return out

    def close(self) -> None:
        for scorer in (self.default, *self.by_source.values()):
            scorer.close()


def build_routed_scorer(
    cfg: RewardConfig, sources: list[SourceConfig], *, truncated_reward: float | None = None
) -> RewardScorer | RoutedScorer:
    """The scorer of ``reward.terms``, routed to each source's own terms where it has them."""
    default = build_scorer(cfg, truncated_reward=truncated_reward)
    own = [s for s in sources if s.reward is not None]
    if not own:
        return default
    by_source = {
        s.name: build_scorer(
            cfg.model_copy(update={"terms": s.reward}), truncated_reward=truncated_reward
        )
        for s in own
    }
    return RoutedScorer(default, by_source)
