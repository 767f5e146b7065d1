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
``score`` method loads as a batched scorer factory. Name lookups live in
``rewards/catalog.py``, which imports the built-in reward modules; this module
imports none of them, so the built-ins register without a cycle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rlpost.errors import one_line
from rlpost.registry import Registry, where
from rlpost.types import RewardSample

RewardFn = Callable[..., float | None]


class BatchScorer(Protocol):
    """A reward that scores a whole batch at once (reward model, judge)."""

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]: ...


ScorerFactory = Callable[..., BatchScorer]

REWARDS: Registry[RewardFn] = Registry("reward function")
SCORERS: Registry[ScorerFactory] = Registry("batched reward scorer")


def reward_function(
    name: str, *, concurrency: int = 1, check: Callable[..., None] | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a per-sample reward function under ``name``.

    ``concurrency > 1`` marks an I/O-bound function (it waits on a subprocess or
    the network): the scorer then calls it on up to that many samples at once
    from a thread pool. ``check(**params)`` raises ValueError for parameter
    values the function would refuse on its first sample, so a config is
    refused at load, not after the warm-up."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in SCORERS:
            raise ValueError(f"reward {name!r} is already registered as a batched scorer")
        fn.concurrency = concurrency  # type: ignore[attr-defined]
        fn.check_values = check  # type: ignore[attr-defined]
        return REWARDS.register(name)(fn)

    return deco


def batched_scorer(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    """Decorator registering a batched scorer factory (usually a class) under ``name``."""

    def deco(factory: ScorerFactory) -> ScorerFactory:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered as a reward function")
        return SCORERS.register(name)(factory)

    return deco


def check_params(
    name: str, fn: Callable[..., Any], params: dict[str, Any], *, per_sample: bool
) -> None:
    """Refuse params ``fn`` does not accept, at build time rather than mid-run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        sig.bind(*([None] if per_sample else []), **params)  # a per-sample fn's ``sample``
    except TypeError as exc:
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "sample"
        ]
        takes = (
            f"accepted: {', '.join(accepted)}" if accepted else "a reward is fn(sample, **params)"
        )
        raise ValueError(
            f"reward {name!r}: {where(fn)} does not take params {sorted(params)} ({exc}); {takes}"
        ) from None
    values = getattr(fn, "check_values", None)
    if values is not None:
        try:
            values(**params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward {name!r}: {one_line(exc)}") from None


__all__ = [
    "REWARDS",
    "SCORERS",
    "BatchScorer",
    "RewardFn",
    "RewardSample",
    "ScorerFactory",
    "batched_scorer",
    "check_params",
    "reward_function",
]
