"""The ``reasoning_gym`` reward: a reasoning-gym task's own scorer on the extracted answer.

The default ``score_answer`` gives partial credit to any reply containing the gold answer, so
the answer is extracted first (``extract``: ``tag``, ``last_line`` or ``whole``); none, or one
over ``max_answer_chars``, scores 0. Only a :class:`~rlpost.data.reasoning_gym.TaskEntry` is
scored (else ``None``). A scorer that evaluates text as code
(:mod:`rlpost.rewards.reasoning_gym_scan`) runs only where the source opted in
(``evaluate_answers``), in the sandbox (:mod:`rlpost.rewards.reasoning_gym_sandbox`); the
rest run in a helper process (:mod:`rlpost.rewards.helper`) within ``timeout_s``. Scores are
clipped to [0, 1]; a scorer error scores 0, numbers too large or a timeout score NaN, each
counted.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from typing import Any

from rlpost.data.reasoning_gym import TaskEntry
from rlpost.rewards.helper import Helper, Overran
from rlpost.rewards.reasoning_gym_scan import task_evaluates
from rlpost.rewards.registry import batched_scorer
from rlpost.rewards.verifiable import extract_tag, numbers_bounded
from rlpost.types import RewardSample

EXTRACTS = ("tag", "last_line", "whole")


def _check(
    *,
    extract: str = "tag",
    tag: str = "answer",
    max_answer_chars: int = 20_000,
    sandbox: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
):
    """Refuse bad params; the ``SandboxConfig`` that ``sandbox`` names."""
    if extract not in EXTRACTS:
        raise ValueError(f"extract={extract!r} must be one of {', '.join(EXTRACTS)}")
    if extract == "tag" and not tag:
        raise ValueError("extract=tag needs a tag name (tag=answer)")
    if isinstance(max_answer_chars, bool) or not (
        isinstance(max_answer_chars, int) and max_answer_chars >= 1
    ):
        raise ValueError(f"max_answer_chars={max_answer_chars!r} must be an integer >= 1")
    if isinstance(timeout_s, bool) or not (
        isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0
    ):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    from rlpost.rewards.sandbox import SandboxConfig

    try:
        return SandboxConfig(**(sandbox or {}))
    except TypeError as exc:
        raise ValueError(f"sandbox={sandbox!r}: {exc}") from None


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


@functools.cache
def _dataset(task: str, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(config))


def score_answers(items: list[tuple[str, dict, dict, str]]) -> list[float]:
    """Each ``(task, config, entry, answer)``'s score by its task's own scorer, NaN where it
    raised (prime_factorization on a non-number); run in the helper process."""
    out = []
    for task, config, entry, answer in items:
        dataset = _dataset(task, json.dumps(config, sort_keys=True, default=str))
        try:
            value = float(dataset.score_answer(answer, entry))
        except Exception:
            value = math.nan
        out.append(value if math.isfinite(value) else math.nan)
    return out


def evaluating_refused(calls: Sequence[str]) -> str:
    """Why a task whose scorer makes ``calls`` is refused without the opt-in (one phrase)."""
    return (
        f"its scorer evaluates the answer as code ({', '.join(calls[:3])}); set "
        "evaluate_answers=true beside it to score it in the sandbox"
    )


@batched_scorer("reasoning_gym")
class ReasoningGymScorer:
    """The reasoning-gym task's own scorer of each prompt, on the extracted answer."""

    default_kind = "verifiable"
    check_values = staticmethod(_check)

    def __init__(
        self,
        extract: str = "tag",
        tag: str = "answer",
        max_answer_chars: int = 20_000,
        sandbox: dict[str, Any] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.sandbox = _check(
            extract=extract,
            tag=tag,
            max_answer_chars=max_answer_chars,
            sandbox=sandbox,
            timeout_s=timeout_s,
        )
        self.extract, self.tag = extract, tag
        self.max_answer_chars, self.timeout_s = max_answer_chars, timeout_s
        self._helper = Helper()
        counts = ("scorer_errors", "no_answer", "too_long", "too_large", "timed_out")
        self._counts = dict.fromkeys((*counts, "sandboxed", "sandbox_restarts"), 0)

    def _answer(self, sample: RewardSample) -> tuple[TaskEntry, str] | float | None:
        """The sample's entry and answer, or its score when no scorer need be asked."""
        meta = sample.metadata.get("reasoning_gym") if sample.metadata else None
        if not isinstance(meta, TaskEntry):
            return None  # not a row rlpost's reasoning-gym source generated
        calls = task_evaluates(meta.task)
        if calls and not meta.evaluate_answers:
            raise ValueError(f"task={meta.task}: {evaluating_refused(calls)}")
        answer = extract_answer(sample.completion, self.extract, self.tag)
        if answer is None:
            self._counts["no_answer"] += 1
            return 0.0
        if len(answer) > self.max_answer_chars:
            self._counts["too_long"] += 1
            return 0.0
        if not calls and not numbers_bounded(answer):
            self._counts["too_large"] += 1
            return math.inf  # past the error count below: NaN, an invalid score
        return meta, answer

    def _in_process(self, items: list[tuple]) -> list[float]:
        """Scores of ``items`` in the helper: the batch within ``timeout_s``, else one by one
        within ``timeout_s`` each, an overrun scoring inf (counted; NaN, invalid, below)."""
        try:
            return self._helper.call(score_answers, items, timeout_s=self.timeout_s)
        except Overran:
            return [self._one(item) for item in items]

    def _one(self, item: tuple) -> float:
        try:
            return self._helper.call(score_answers, [item], timeout_s=self.timeout_s)[0]
        except Overran:
            self._counts["timed_out"] += 1
            return math.inf

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]:
        out: list[float | None] = []
        confined: list[tuple[int, tuple]] = []
        here: list[tuple[int, tuple]] = []
        for i, sample in enumerate(samples):
            got = self._answer(sample)
            out.append(got if not isinstance(got, tuple) else math.nan)
            if isinstance(got, tuple):
                item = (got[0].task, got[0].config, got[0].entry, got[1])
                (confined if task_evaluates(got[0].task) else here).append((i, item))
        if here:
            for (i, _), value in zip(here, self._in_process([it for _, it in here]), strict=True):
                out[i] = value
        if confined:
            self._counts["sandboxed"] += len(confined)
            from rlpost.rewards.reasoning_gym_sandbox import score_in_sandbox

            items = [item for _, item in confined]
            values, runs = score_in_sandbox(items, self.sandbox, self.timeout_s)
            self._counts["sandbox_restarts"] += runs - 1
            for (i, _), value in zip(confined, values, strict=True):
                out[i] = value
        return [self._finite(v) for v in out]

    def _finite(self, value: float | None) -> float | None:
        if value is None or math.isinf(value):  # inf: a bound was hit, counted where it was
            return None if value is None else math.nan
        if not math.isfinite(value):
            self._counts["scorer_errors"] += 1
            return 0.0
        return min(max(value, 0.0), 1.0)

    def close(self) -> None:
        self._helper.close()

    def counters(self) -> dict[str, int]:
        return dict(self._counts)
