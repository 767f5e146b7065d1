"""Look up an environment by name: the built-in ones, or ``package.module:Class``.

Importing this module imports every built-in environment module, so they are
registered; ``envs/base.py`` never imports them back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rlpost.envs import calculator, countdown, python  # noqa: F401
from rlpost.envs import verifiers_env as _verifiers_env  # noqa: F401
from rlpost.envs.base import ENVS, Action, EnvError, Environment, checked_step
from rlpost.registry import UnknownNameError, UserCodeError, import_object
from rlpost.types import Prompt


def load_env_class(name: str) -> type:
    """The class registered as ``name``, or ``package.module:Class``; EnvError otherwise."""
    if ":" in name:
        try:
            obj = import_object(name)
        except ValueError as exc:
            raise EnvError(f"environment {name!r}: {exc}") from None
        if not inspect.isclass(obj) or not callable(getattr(obj, "step", None)):
            raise EnvError(f"environment {name!r}: {name} is no class with step()")
        return obj
    try:
        return ENVS.get(name)
    except UnknownNameError as exc:
        raise EnvError(f"{exc} (or package.module:Class)") from None


def env_factory(name: str, params: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A function that builds a fresh environment per episode; one is built here so a bad
    name or parameter fails now, in one line, not in the middle of a rollout."""
    cls = load_env_class(name)
    params = dict(params or {})
    try:
        probe = cls(**params)
    except TypeError as exc:
        raise EnvError(f"environment {name!r}: bad parameters {sorted(params)} ({exc})") from None
    tools = getattr(probe, "tools", None)
    if not isinstance(tools, tuple) or not all(isinstance(t, str) for t in tools):
        raise EnvError(f"environment {name!r}: tools must be a tuple of names, got {tools!r}")
    if ":" in name:  # the user's class: one answer turn on a dummy prompt, before any work
        try:
            probe.reset(Prompt("1+1=", 2))
            checked_step(probe, Action("2"))
        except UserCodeError as exc:
            raise EnvError(str(exc)) from None
        except Exception:  # a prompt it cannot take says nothing; its first episode will
            pass
    return lambda: cls(**params)
