"""Math answers checked by symbolic equivalence with ``math-verify``.

As Open R1 and lighteval count it. math-verify's ``signal.alarm`` works on the main thread
only, so elsewhere the check runs in a helper process, killed a few seconds past the timeout
(``\boxed{10^{10^{10}}}`` keeps sympy busy past any character limit).
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

    The answer follows the last ``####``, else the last ``\\boxed{}``, else math-verify's
    extraction (``tag``: the last ``<tag>`` block); the reference is read alike."""
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
