"""Math answers checked by symbolic equivalence with ``math-verify``.

String or float comparison marks ``\\frac{1}{2}``, ``0.5`` and ``\\boxed{\\tfrac12}``
as different answers; math-verify parses LaTeX and plain expressions into sympy
and compares them symbolically, which is what the leaderboards built on it
(Open R1, lighteval) count as correct.

math-verify bounds its own run time with ``signal.alarm``, which only works on
the main thread; on any other thread (an async pipeline, a scorer pool) the
alarm is switched off and the completion is cut to its last ``max_chars``
characters instead, so a pathological completion cannot stall scoring for long.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from rlpost.rewards.registry import reward_function
from rlpost.rewards.verifiable import extract_final_answer, extract_tag
from rlpost.types import RewardSample


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple[Any, ...]:
    # A GRPO group scores n completions against the same reference: parse it once.
    from math_verify import parse

    parsed = parse(gold, parsing_timeout=timeout)
    if not parsed:
        parsed = parse(f"${gold}$", parsing_timeout=timeout)
    # An answer sympy cannot read (a name, a word) is still compared as a string.
    return tuple(parsed) if parsed else (gold.strip(),)


@reward_function("math_verify")
def math_verify_reward(
    sample: RewardSample,
    *,
    tag: str | None = None,
    max_chars: int = 4000,
    timeout_seconds: int = 5,
    float_rounding: int = 6,
) -> float | None:
    """1.0 if the completion's final answer is mathematically equal to the reference.

    The answer is what follows the last ``####`` (GSM8K), else the last ``\\boxed{}``,
    else the last LaTeX or plain expression (math-verify's default extraction); ``tag``
    restricts it to the last ``<tag>...</tag>`` block. A reference that is a worked
    solution is read the same way. ``None`` when the sample has no reference answer.
    """
    if sample.answer is None or str(sample.answer).strip() == "":
        return None
    text = sample.completion if tag is None else extract_tag(sample.completion, tag)
    if not text or not text.strip():
        return 0.0
    from math_verify import parse, verify

    timeout = _timeout(timeout_seconds)
    reference = str(sample.answer)
    if "####" in reference:
        reference = extract_final_answer(reference) or reference
    gold = list(_parse_gold(reference, timeout))
    if "####" in text:
        text = extract_final_answer(text) or ""
        if not text:
            return 0.0
    predicted = parse(text[-max_chars:], parsing_timeout=timeout)
    if not predicted:
        return 0.0
    ok = verify(gold, predicted, float_rounding=float_rounding, timeout_seconds=timeout)
    return 1.0 if ok else 0.0
