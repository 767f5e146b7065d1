"""The answer a reply states, as the reward terms that score it read it (majority vote).

Replies a reward scores alike give one answer (``"12"`` and ``" 12.0"`` under
``numeric_match``): the first known term's extraction applies, else the stripped text.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from rlpost.config import RewardTerm
from rlpost.rewards.reasoning_gym import extract_answer
from rlpost.rewards.verifiable import (
    extract_final_answer,
    extract_tag,
    normalize_text,
    stated_number,
)

Extractor = Callable[[str], Hashable | None]


def _tagged(tag: str | None, read: Callable[[str], Hashable | None]) -> Extractor:
    """``read`` of the last ``<tag>`` block (no block: no answer), or of the whole text."""
    if tag is None:
        return read
    return lambda text: None if (inner := extract_tag(text, tag)) is None else read(inner)


def _numeric(tag: str | None = None, position: str = "first", **_) -> Extractor:
    return _tagged(tag, lambda text: stated_number(text, position))


def _exact(
    tag: str | None = None,
    strip: bool = True,
    ignore_case: bool = False,
    collapse_space: bool = False,
    **_,
) -> Extractor:
    return _tagged(tag, lambda text: normalize_text(text, strip, ignore_case, collapse_space))


def _reasoning_gym(extract: str = "tag", tag: str = "answer", **_) -> Extractor:
    return lambda text: extract_answer(text, extract, tag)


def _math(tag: str | None = None, **_) -> Extractor:
    return _tagged(tag, lambda text: (extract_final_answer(text) or text).strip() or None)


EXTRACTORS: dict[str, Callable[..., Extractor]] = {
    "numeric_match": _numeric,
    "exact_match": _exact,
    "reasoning_gym": _reasoning_gym,
    "math_verify": _math,
}


def answer_extractor(terms: list[RewardTerm]) -> Extractor:
    """How the first term with a known extraction reads a reply's answer (else the
    stripped reply)."""
    for t in terms:
        if t.name in EXTRACTORS:
            return EXTRACTORS[t.name](**t.params())
    return lambda text: text.strip() or None
