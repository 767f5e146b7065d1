"""Rule rewards: shape the form of a completion, not its correctness.

Hackable alone, so mixed with a verifiable term at a small weight. Length terms read
``sample.num_tokens``, the engine's count.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from rlpost.algos.sampling import overlong_penalty as soft_overlong_penalty
from rlpost.rewards.registry import reward_function
from rlpost.types import RewardSample

THINK_ANSWER = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


@lru_cache(maxsize=64)
def _compile(pattern: str, dotall: bool, ignore_case: bool) -> re.Pattern[str]:
    flags = (re.DOTALL if dotall else 0) | (re.IGNORECASE if ignore_case else 0)
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"format: invalid regex {pattern!r} ({exc})") from None


def _check_format(
    *, pattern: str = THINK_ANSWER, dotall: bool = True, ignore_case: bool = False, **_
):
    _compile(pattern, dotall, ignore_case)


@reward_function("format", check=_check_format)
def format_reward(
    sample: RewardSample,
    *,
    pattern: str = THINK_ANSWER,
    dotall: bool = True,
    ignore_case: bool = False,
) -> float:
    """1.0 if the completion matches ``pattern`` (``re.search``), by default the R1-Zero
    template (DeepSeek-R1, 2025, section 2.2.2)."""
    return 1.0 if _compile(pattern, dotall, ignore_case).search(sample.completion) else 0.0


def _max_tokens(sample: RewardSample, max_tokens: int | None) -> int | None:
    value = max_tokens if max_tokens is not None else sample.max_tokens
    return value if value and value > 0 else None


@reward_function("overlong_penalty")
def overlong_penalty(
    sample: RewardSample, *, max_tokens: int | None = None, cache_len: int | None = None
) -> float | None:
    """DAPO soft overlong punishment (Yu et al., 2025, eq. 13) of ``sample.num_tokens``: the
    math is :func:`rlpost.algos.overlong_penalty`'s. ``max_tokens`` defaults to
    ``sample.max_tokens``, ``cache_len`` to a fifth of it; ``None`` without a budget."""
    l_max = _max_tokens(sample, max_tokens)
    if l_max is None:
        return None
    cache = cache_len if cache_len is not None else max(1, round(0.2 * l_max))
    try:
        penalty = soft_overlong_penalty(
            torch.tensor([sample.num_tokens]), l_max, cache, dtype=torch.float64
        )
    except ValueError as exc:
        raise ValueError(f"overlong_penalty: {exc}") from None
    return float(penalty[0])


@reward_function("length")
def length_reward(
    sample: RewardSample,
    *,
    min_tokens: int = 0,
    max_tokens: int | None = None,
    tolerance: int = 1,
) -> float | None:
    """0.0 inside ``[min_tokens, max_tokens]``, else ``-min(1, distance / tolerance)``;
    ``max_tokens`` defaults to ``sample.max_tokens``."""
    if tolerance < 1:
        raise ValueError(f"length: tolerance must be >= 1, got {tolerance}")
    upper = _max_tokens(sample, max_tokens)
    if min_tokens <= 0 and upper is None:
        return None
    n = sample.num_tokens
    if n < min_tokens:
        distance = min_tokens - n
    elif upper is not None and n > upper:
        distance = n - upper
    else:
        return 0.0
    return -min(1.0, distance / tolerance)


@reward_function("repetition")
def repetition_penalty(sample: RewardSample, *, n: int = 3, unit: str = "word") -> float:
    """Minus the fraction of repeated n-grams: ``-(total - unique) / total``."""
    if n < 1:
        raise ValueError(f"repetition: n must be >= 1, got {n}")
    if unit == "word":
        units: list[str] | str = sample.completion.split()
    elif unit == "char":
        units = sample.completion
    else:
        raise ValueError(f"repetition: unit must be 'word' or 'char', got {unit!r}")
    grams = [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
    if not grams:
        return 0.0
    return -(len(grams) - len(set(grams))) / len(grams)
