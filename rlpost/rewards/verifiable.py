"""Verifiable rewards: the answer can be checked exactly.

1.0 or 0.0; ``None`` without a usable reference. A garbled or huge completion scores 0.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from functools import partial
from typing import Any

from rlpost.rewards.registry import reward_function
from rlpost.types import RewardSample

# Not glued to a digit or dot: "5-3" reads 5 and 3, "1.2.3" no stray "3"; "1,000" is one.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


MAX_EXPONENT = 1000
"""The largest exponent (``1e1000``) numeric text may carry into exact arithmetic."""
MAX_DIGITS = 4300
"""The longest run of digits it may hold (Python's own limit for ``int`` of a string)."""
_EXPONENT = re.compile(r"(?<=[\d.])[eE]\s*[-+]?\s*([\d_]+)")
_DIGITS = re.compile(rf"[\d_]{{{MAX_DIGITS + 1}}}")


def numbers_bounded(text: str) -> bool:
    """Whether every number in ``text`` is small enough for exact arithmetic: ``Fraction``
    and ``Decimal`` turn ``1e999999999`` into a billion-digit integer (hours of work)."""
    if _DIGITS.search(text):
        return False
    exponents = (int(m.group(1).replace("_", "") or 0) for m in _EXPONENT.finditer(text))
    return all(e <= MAX_EXPONENT for e in exponents)


def _to_float(token: str) -> float | None:
    try:
        value = float(token.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _numbers(text: str) -> Iterable[float]:
    for m in _NUMBER.finditer(text):
        value = _to_float(m.group(0))
        if value is not None:
            yield value


def extract_last_number(text: str) -> float | None:
    """The last finite number written in ``text`` ("1,000" is one number), or None."""
    values = list(_numbers(text))
    return values[-1] if values else None


def extract_first_number(text: str) -> float | None:
    """The first finite number written in ``text``, or None."""
    return next(iter(_numbers(text)), None)


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` block in ``text``, or None if absent."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1] if found else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None  # unclosed: no answer was stated


def extract_final_answer(text: str) -> str | None:
    """The answer a solution states as final: after the last ``####`` (GSM8K), else the last
    ``\\boxed{}`` (MATH, most reasoning models); None when the text marks none."""
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    return extract_boxed(text)


def stated_number(text: str, position: str = "first") -> float | None:
    """The ``first`` or ``last`` number of ``text``'s final answer (else of ``text``)."""
    final = extract_final_answer(text)
    text = final if final is not None else text
    return extract_first_number(text) if position == "first" else extract_last_number(text)


def normalize_text(
    text: str, strip: bool = True, ignore_case: bool = False, collapse_space: bool = False
) -> str:
    """``text`` as ``exact_match`` compares it."""
    if collapse_space:
        text = " ".join(text.split())
    if strip:
        text = text.strip()
    return text.lower() if ignore_case else text


def _reference_number(answer: Any) -> float | None:
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int | float):
        return float(answer) if math.isfinite(answer) else None
    if isinstance(answer, str):
        final = extract_final_answer(answer)  # a worked solution ending "#### 72"
        m = _NUMBER.fullmatch((final if final is not None else answer).strip())
        return _to_float(m.group(0)) if m else None
    return None


def _answer_text(sample: RewardSample, tag: str | None) -> str | None:
    return sample.completion if tag is None else extract_tag(sample.completion, tag)


def _check_numeric(*, position: str = "first", **_) -> None:
    if position not in ("first", "last"):
        raise ValueError(f"numeric_match: position must be 'first' or 'last', got {position!r}")


@reward_function("numeric_match", check=_check_numeric)
def numeric_match(
    sample: RewardSample,
    *,
    position: str = "first",
    rel_tol: float = 1e-9,
    abs_tol: float = 1e-9,
    tag: str | None = None,
) -> float | None:
    """1.0 if the number in the completion equals the reference answer.

    ``position``: ``first`` or ``last`` number, unless a marker (``#### 42``,
    ``\\boxed{42}``) says; ``tag``: only the last ``<tag>`` block. The reference may be a
    worked solution ending in a marker (GSM8K)."""
    _check_numeric(position=position)
    target = _reference_number(sample.answer)
    if target is None:
        return None
    text = _answer_text(sample, tag)
    if text is None:
        return 0.0
    got = stated_number(text, position)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, target, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


@reward_function("exact_match")
def exact_match(
    sample: RewardSample,
    *,
    strip: bool = True,
    ignore_case: bool = False,
    collapse_space: bool = False,
    tag: str | None = None,
) -> float | None:
    """1.0 if the completion equals the answer (or one of a list) as a string."""
    if sample.answer is None:
        return None
    accepted = sample.answer if isinstance(sample.answer, list | tuple) else [sample.answer]
    if not accepted:
        return None
    text = _answer_text(sample, tag)
    if text is None:
        return 0.0

    norm = partial(
        normalize_text, strip=strip, ignore_case=ignore_case, collapse_space=collapse_space
    )
    got = norm(text)
    return 1.0 if any(got == norm(str(a)) for a in accepted) else 0.0
