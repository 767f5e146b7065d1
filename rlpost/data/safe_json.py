"""JSON from outside (dataset lines, request bodies) parsed with a bound on nesting.

Deep nesting breaks ``json.loads`` or later recursive code, so past :data:`MAX_DEPTH` it is
refused as :class:`TooDeep` (a ValueError).
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than the bound."""


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, refusing nesting deeper than ``max_depth`` with :class:`TooDeep`."""
    opening = text.count(b"[" if isinstance(text, bytes) else "[")
    opening += text.count(b"{" if isinstance(text, bytes) else "{")
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nested deeper than {max_depth} levels") from None
    # Fewer brackets than the bound (the usual case) cannot nest deeper: no walk.
    if opening > max_depth and depth(value, max_depth) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels")
    return value


def depth(value: Any, stop_after: int) -> int:
    """Nesting depth of lists and dicts in ``value`` (a scalar is 0), iteratively;
    stops counting once it passes ``stop_after``."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        deepest = max(deepest, level)
        if deepest > stop_after:
            return deepest
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest
