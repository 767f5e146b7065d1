"""Held-out metrics of several samples per problem: mean@k, pass@k, maj@k.

``correct``: one problem's samples in draw order; ``answers``: their answers (None: none).

- mean@k: fraction correct among the first k samples.
- pass@k: the unbiased 1 - C(n-c, k) / C(n, k) over all n (Chen et al. 2021); n >= k.
- maj@k: the first k samples' majority answer is correct; a tie goes to the answer first at
  the top count.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

METRIC_NAMES = ("mean", "pass", "maj")
_KINDS = ("mean", "pass", "maj")


def parse_metric(name: str) -> tuple[str, int]:
    """``"pass@8"`` -> ("pass", 8); ``"greedy"`` -> ("greedy", 1); ValueError otherwise."""
    if name == "greedy":
        return "greedy", 1
    kind, at, k = name.partition("@")
    # k: a positive decimal without a leading zero (isdecimal alone takes other scripts' digits)
    if kind not in _KINDS or not at or not k.isascii() or not k.isdigit() or k[0] == "0":
        raise ValueError(f"{name!r} is not mean@k, pass@k, maj@k or greedy")
    return kind, int(k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(correct: Sequence[bool], k: int) -> float:
    """Fraction correct among the first ``k`` samples."""
    if not 1 <= k <= len(correct):
        raise ValueError(f"mean@{k} needs at least {k} samples, got {len(correct)}")
    return sum(bool(x) for x in correct[:k]) / k


def majority_index(answers: Sequence[Hashable | None]) -> int | None:
    """Index of the sample whose answer wins the vote (ties: the answer that reached the top
    count first), or None when no sample has an answer."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    best: Hashable | None = None
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
        if best is None or counts[a] > counts[best]:  # strictly more: the earlier one keeps ties
            best = a
    return None if best is None else first[best]


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first ``k`` samples is correct, else 0.0."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers for {len(correct)} samples")
    if not 1 <= k <= len(correct):
        raise ValueError(f"maj@{k} needs at least {k} samples, got {len(correct)}")
    i = majority_index(answers[:k])
    return 0.0 if i is None else float(bool(correct[i]))


def problem_metric(
    kind: str, k: int, correct: Sequence[bool], answers: Sequence[Hashable | None]
) -> float:
    """One problem's value of metric ``kind@k`` (mean, pass or maj)."""
    if kind == "mean":
        return mean_at_k(correct, k)
    if kind == "pass":
        return pass_at_k(len(correct), sum(bool(x) for x in correct), k)
    if kind == "maj":
        return maj_at_k(answers, correct, k)
    raise ValueError(f"unknown metric kind {kind!r}; one of {', '.join(METRIC_NAMES)}")
