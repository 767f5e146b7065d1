"""Math answers checked by symbolic equivalence with ``math-verify``.

String or float comparison marks ``\\frac{1}{2}``, ``0.5`` and ``\\boxed{\\tfrac12}``
as different answers; math-verify parses LaTeX and plain expressions into sympy
and compares them symbolically, which is what the leaderboards built on it
(Open R1, lighteval) count as correct.

math-verify bounds its own run time with ``signal.alarm``, which only works on
the main thread. On any other thread (the overlapped pipeline's producer, a
worker process's call pool) the check runs in a helper process instead, on its
main thread where the alarm works, and the caller also waits at most a few
seconds past the timeout before it kills the helper and scores 0: a short
completion like ``\boxed{10^{10^{10}}}`` keeps sympy busy far longer than any
character limit would prevent.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from rlpost.rewards.helper import Helper, Overran
from rlpost.rewards.registry import reward_function
from rlpost.rewards.verifiable import extract_final_answer, extract_tag
from rlpost.types import RewardSample


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_HELPER = Helper()


def _check(reference: str, text: str, timeout: int | None, rounding: int) -> bool:
    """Is ``text``'s answer ``reference``? (math-verify; ``timeout`` needs the main thread)"""
    from math_verify import parse, verify

    gold = list(_parse_gold(reference, timeout))
    predicted = parse(text, parsing_timeout=timeout)
    if not predicted:
        return False
    return bool(verify(gold, predicted, float_rounding=rounding, timeout_seconds=timeout))


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
    reference = str(sample.answer)
    if "####" in reference:
        reference = extract_final_answer(reference) or reference
    if "####" in text:
        text = extract_final_answer(text) or ""
        if not text:
            return 0.0
    text = text[-max_chars:]
    if _on_main_thread():
        ok = _check(reference, text, timeout_seconds, float_rounding)
    else:  # no alarm off the main thread: a helper process that can be killed
        try:  # math-verify's own timeouts, then a margin before the helper is killed
            args = (reference, text, timeout_seconds, float_rounding)
            ok = _HELPER.call(_check, *args, timeout_s=2 * timeout_seconds + 10)
        except Overran:
            ok = False
    return 1.0 if ok else 0.0
