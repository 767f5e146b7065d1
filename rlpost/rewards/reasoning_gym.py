"""The ``reasoning_gym`` reward: a reasoning-gym task's own scorer on the extracted answer.

reasoning-gym's default ``score_answer`` gives partial credit ``len(gold)/len(reply)``
to any reply that contains the gold answer ("12345" scores 0.2 against "3"), so
the answer is extracted first: the last ``<answer>...</answer>`` block
(``extract=tag``), the last non-empty line (``last_line``) or the whole reply
(``whole``). No answer found scores 0 without asking the scorer. The scorer gets
the task's in-memory entry (``Prompt.metadata["reasoning_gym"]``, kept by
:mod:`rlpost.data.reasoning_gym`); one that raises scores 0 and is counted
(``scorer_errors``), as are replies without an answer (``no_answer``). A sample
of another source is not applicable (``None``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rlpost.rewards.registry import batched_scorer
from rlpost.rewards.verifiable import extract_tag
from rlpost.types import RewardSample

EXTRACTS = ("tag", "last_line", "whole")


def _check(*, extract: str = "tag", tag: str = "answer") -> None:
    if extract not in EXTRACTS:
        raise ValueError(f"extract={extract!r} must be one of {', '.join(EXTRACTS)}")
    if extract == "tag" and not tag:
        raise ValueError("extract=tag needs a tag name (tag=answer)")


def extract_answer(text: str, extract: str, tag: str) -> str | None:
    """The answer in ``text`` as ``extract`` says; None when there is none."""
    if extract == "tag":
        found = extract_tag(text, tag)
    elif extract == "last_line":
        lines = [line for line in text.splitlines() if line.strip()]
        found = lines[-1] if lines else None
    else:
        found = text
    found = found.strip() if found is not None else None
    return found or None


@batched_scorer("reasoning_gym")
class ReasoningGymScorer:
    """The reasoning-gym task's own scorer of each prompt, on the extracted answer."""

    default_kind = "verifiable"
    check_values = staticmethod(_check)

    def __init__(self, extract: str = "tag", tag: str = "answer") -> None:
        _check(extract=extract, tag=tag)
        self.extract, self.tag = extract, tag
        self._datasets: dict[tuple[str, str], Any] = {}
        self._counts = {"scorer_errors": 0, "no_answer": 0}

    def _dataset(self, task: str, config: dict):
        key = (task, json.dumps(config, sort_keys=True, default=str))
        if key not in self._datasets:
            import reasoning_gym

            self._datasets[key] = reasoning_gym.create_dataset(task, seed=0, size=1, **config)
        return self._datasets[key]

    def score_one(self, sample: RewardSample) -> float | None:
        meta = sample.metadata.get("reasoning_gym") if sample.metadata else None
        if not isinstance(meta, dict) or "entry" not in meta:
            return None  # not a reasoning-gym prompt
        answer = extract_answer(sample.completion, self.extract, self.tag)
        if answer is None:
            self._counts["no_answer"] += 1
            return 0.0
        dataset = self._dataset(meta["task"], meta["config"])
        try:
            value = float(dataset.score_answer(answer, meta["entry"]))
        except Exception:  # a task's scorer raising on an odd answer (prime_factorization)
            value = math.nan
        if not math.isfinite(value):
            self._counts["scorer_errors"] += 1
            return 0.0
        return value

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]:
        return [self.score_one(s) for s in samples]

    def counters(self) -> dict[str, int]:
        return dict(self._counts)
