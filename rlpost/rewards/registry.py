"""The reward registries: rewards by name, or by ``package.module:function``.

Two kinds of reward exist, and one lookup serves both:

* a **per-sample reward** is a plain callable
  ``fn(sample: RewardSample, **params) -> float | None`` (``None``: not applicable
  to this sample), registered in ``REWARDS``. Verifiable and rule rewards are these.
* a **batched scorer** is a factory ``factory(**params) -> scorer`` whose result has
  ``score(samples) -> list[float | None]``, registered in ``SCORERS``. Reward
  models and LLM judges are these: they are expensive to build, hold resources
  (weights, an HTTP client) and are much faster per batch than per sample.

A name is unique across both tables, so a config term names either kind the same
way. ``package.module:function`` loads a callable from user code; a class with a
``score`` method loads as a batched scorer factory.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from rlpost.registry import Registry, UnknownNameError
from rlpost.types import RewardSample

RewardFn = Callable[..., float | None]


class BatchScorer(Protocol):
    """A reward that scores a whole batch at once (reward model, judge)."""

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]: ...


ScorerFactory = Callable[..., BatchScorer]

REWARDS: Registry[RewardFn] = Registry("reward function")
SCORERS: Registry[ScorerFactory] = Registry("batched reward scorer")


def reward_function(name: str, *, concurrency: int = 1) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a per-sample reward function under ``name``.

    ``concurrency > 1`` marks an I/O-bound function (it waits on a subprocess or
    the network): the scorer then calls it on up to that many samples at once
    from a thread pool.
    """

    def deco(fn: RewardFn) -> RewardFn:
        if name in SCORERS:
            raise ValueError(f"reward {name!r} is already registered as a batched scorer")
        fn.concurrency = concurrency  # type: ignore[attr-defined]
        return REWARDS.register(name)(fn)

    return deco


def batched_scorer(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    """Decorator registering a batched scorer factory (usually a class) under ``name``."""

    def deco(factory: ScorerFactory) -> ScorerFactory:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered as a reward function")
        return SCORERS.register(name)(factory)

    return deco


def load_builtin_rewards() -> None:
    """Import every built-in reward module so that its rewards are registered.

    Done lazily so importing the registry alone stays cheap; the heavy libraries
    (math-verify, torch, httpx) are imported only when a reward is first called
    or built.
    """
    from rlpost.rewards import code, countdown, judge, model, rule, verifiable  # noqa: F401
    from rlpost.rewards import math as _math  # noqa: F401


def _import_object(name: str) -> Any:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"reward {name!r}: {module_name} has no callable {attr!r}")
    return obj


def lookup(name: str) -> tuple[Literal["sample", "batch"], Callable[..., Any]]:
    """Resolve ``name`` to ``("sample", fn)`` or ``("batch", factory)``.

    Raises ``UnknownNameError`` listing every valid name of both kinds.
    """
    if ":" in name:
        obj = _import_object(name)
        is_scorer_class = inspect.isclass(obj) and callable(getattr(obj, "score", None))
        return ("batch", obj) if is_scorer_class else ("sample", obj)
    load_builtin_rewards()
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


def check_params(
    name: str, fn: Callable[..., Any], params: dict[str, Any], *, per_sample: bool
) -> None:
    """Refuse params ``fn`` does not accept, at build time rather than mid-run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        if per_sample:
            sig.bind(None, **params)
        else:
            sig.bind(**params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "sample"
        ]
        raise ValueError(
            f"reward {name!r}: bad params {sorted(params)} ({exc}); accepted: {', '.join(accepted)}"
        ) from None


def describe_rewards() -> list[tuple[str, str, str, str]]:
    """(name, kind, parameters with defaults, first line of the docstring) of every built-in
    reward; ``rlpost rewards`` prints them."""
    load_builtin_rewards()
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


__all__ = [
    "REWARDS",
    "SCORERS",
    "BatchScorer",
    "RewardFn",
    "RewardSample",
    "ScorerFactory",
    "batched_scorer",
    "check_params",
    "describe_rewards",
    "get_reward",
    "load_builtin_rewards",
    "lookup",
    "reward_function",
]
