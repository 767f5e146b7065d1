"""Look up a reward by name: the built-in ones, or ``package.module:function``.

Importing it registers every built-in reward; heavy libraries load at first use.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from rlpost.registry import UnknownNameError, import_callable
from rlpost.rewards import code, countdown, judge, model, rule, verifiable  # noqa: F401
from rlpost.rewards import math as _math  # noqa: F401
from rlpost.rewards import reasoning_gym as _reasoning_gym  # noqa: F401
from rlpost.rewards import verifiers_rubric as _verifiers_rubric  # noqa: F401
from rlpost.rewards.registry import REWARDS, SCORERS, RewardFn


def lookup(name: str) -> tuple[Literal["sample", "batch"], Callable[..., Any]]:
    """Resolve ``name`` to ``("sample", fn)`` or ``("batch", factory)``."""
    if ":" in name:
        obj = import_callable(name, "reward")
        is_scorer_class = inspect.isclass(obj) and callable(getattr(obj, "score", None))
        return ("batch", obj) if is_scorer_class else ("sample", obj)
    if name in REWARDS:
        return "sample", REWARDS.get(name)
    if name in SCORERS:
        return "batch", SCORERS.get(name)
    valid = ", ".join(sorted([*REWARDS.names(), *SCORERS.names()]))
    raise UnknownNameError(f"unknown reward {name!r}; valid: {valid} (or package.module:function)")


def get_reward(name: str) -> RewardFn:
    """Look up a per-sample reward by name, or import ``package.module:function``."""
    kind, obj = lookup(name)
    if kind == "batch":
        raise ValueError(f"reward {name!r} is a batched scorer; build it with build_scorer")
    return obj


def describe_rewards() -> list[tuple[str, str, str, str]]:
    """(name, kind, parameters with defaults, first line of the docstring) of every built-in
    reward; ``rlpost rewards`` prints them."""
    rows = []
    for kind, table in (("per-sample", REWARDS), ("batched", SCORERS)):
        for name in table.names():
            fn = table.get(name)
            params = [
                p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "sample"
            ]
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            rows.append((name, kind, ", ".join(params), doc[0] if doc else ""))
    return rows
