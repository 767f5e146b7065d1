"""Per-source health of a step: what the run-wide means hide in a mixture of sources.

Keys ``source/<name>/<metric>`` for each source in the batch, owned here (none for one
source); exported but ``prompts`` as ``rl_source_<metric>{source=...}``.
"""

from __future__ import annotations

import torch

from rlpost.algos import group_zero_spread_fraction
from rlpost.observe.metrics import SOURCE_KEY_PREFIX as PREFIX
from rlpost.types import Group


def source_metrics(groups: list[Group]) -> dict[str, float]:
    """``source/<name>/<field>`` of every source in ``groups`` ({} when none has a source)."""
    by: dict[str, list[Group]] = {}
    for g in groups:
        if g.prompt.source:
            by.setdefault(g.prompt.source, []).append(g)
    out: dict[str, float] = {}
    for name, part in sorted(by.items()):
        scores = [s for g in part for s in g.scores]
        completions = [c for g in part for c in g.completions]
        group = torch.tensor([i for i, g in enumerate(part) for _ in range(g.n)])
        values = {
            "reward_mean": sum(scores) / len(scores),
            "accuracy": sum(s > 0.5 for s in scores) / len(scores),
            "response_length_mean": sum(len(c.token_ids) for c in completions) / len(completions),
            "truncated_frac": sum(c.truncated for c in completions) / len(completions),
            "zero_spread_frac": group_zero_spread_fraction(
                torch.tensor(scores, dtype=torch.float64), group
            ),
            "prompts": float(len(part)),
        }
        out.update({f"{PREFIX}{name}/{k}": float(v) for k, v in values.items()})
    return out
