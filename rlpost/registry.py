"""Name -> object registries.

Every swappable part (advantage estimator, policy loss, KL estimator, aggregation
mode, reward function, engine) is looked up by the same name the config uses.
An unknown name is an error that lists the valid ones, so a typo in a recipe is
caught at load time with the fix in the message.

An entry may carry **traits**, keyword metadata registered with it
(``@ADVANTAGES.register("gae", needs_critic=True)``): what the rest of the
framework must provide for it (a critic, a reference model, groups of samples).
Callers ask ``REG.trait(name, "needs_critic")`` instead of keeping name lists.

A name may also point at user code, ``path/to/file.py:object`` or ``package.module:object``:
the first lookup imports it and registers it under that name, with the params class and
traits it declares with :func:`part`, so callers treat it as any registered part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UserCodeError(RuntimeError):
    """The user's own code (a reward, an environment, a part named ``file.py:fn``) failed or
    answered what its contract does not allow; the one-line message names the function, its
    file and line, and the input."""


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists valid names."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want plain text
        return str(self.args[0])


class Registry(Generic[T]):
    """A named table of objects of one kind (e.g. "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[T], T]:
        """Decorator: ``@REG.register("grpo", group_relative=True)``. Registering a name twice
        is an error; ``traits`` are metadata read back with :meth:`trait`."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            self._traits[name] = dict(traits)
            return obj

        return deco

    def trait(self, name: str, trait: str, default: Any = False) -> Any:
        """The value of ``trait`` registered with ``name`` (``default`` when not given)."""
        self.get(name)  # an unknown name fails here, listing the valid ones
        return self._traits[name].get(trait, default)

    def get(self, name: str) -> T:
        if name not in self._items and ":" in name:  # user code: imported once, then registered
            obj = import_callable(name, self.kind)
            self.register(name, **declared(obj)[1])(guarded(obj, self.kind))
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        """The registered names, without the user code looked up by ``file.py:fn``."""
        return sorted(n for n in self._items if ":" not in n)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))


def part(params: type | None = None, **traits: Any) -> Callable[[T], T]:
    """Decorator for a part in the user's own code: ``params``, a pydantic model its config keys
    beside ``name`` are checked by (its instance's fields reach the part as the built-ins'
    do), and ``traits`` as a registered part's (``needs_reference=True``). Undecorated: the
    keys are taken as given and every trait is false."""

    def deco(obj: T) -> T:
        obj.rlpost_part = (params, traits)  # type: ignore[attr-defined]
        return obj

    return deco


def guarded(fn: Any, kind: str) -> Any:
    """``fn`` (a user's function) raising :class:`UserCodeError` that names it and what it
    raised, so a failure mid-run stops the run in one line with its resume command; classes
    and the function itself (``__wrapped__``, for the load-time probe) are left as they are."""
    import functools
    import inspect

    if not inspect.isfunction(fn):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserCodeError:
            raise
        except Exception as exc:  # the user's code: whatever it raises is its own
            text = " ".join(str(exc).split())[:200]
            raise UserCodeError(f"{kind} {where(fn)} raised {type(exc).__name__}: {text}") from exc

    return call


def declared(obj: Any) -> tuple[type | None, dict[str, Any]]:
    """``(params class, traits)`` that ``obj`` declared with :func:`part`."""
    return getattr(obj, "rlpost_part", (None, {}))


def where(obj: Any) -> str:
    """``name (file:line)`` of a user's function or class, for one-line errors."""
    import inspect
    import os

    obj = inspect.unwrap(obj)
    name = getattr(obj, "__qualname__", repr(obj))
    try:
        file, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return name
    shown = os.path.relpath(file) if file and file.startswith(os.getcwd()) else file
    return f"{name} ({shown}:{line})"


def import_object(spec: str) -> Any:
    """The object ``package.module:name`` or ``path/to/file.py:name`` names (a relative path:
    from the working directory, else from the checkout rlpost lives in), imported once per
    working directory. ValueError saying what is missing; callers put the key that named it
    in front."""
    import os

    return _import_object(spec, os.getcwd())


@functools.cache
def _import_object(spec: str, cwd: str) -> Any:
    import importlib

    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r} must be package.module:name or file.py:name")
    if module_name.endswith(".py"):
        module = _load_file(module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r} ({exc})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{module_name} has no {attr!r}")
    return getattr(module, attr)


def import_callable(spec: str, what: str, error: type[Exception] = ValueError) -> Any:
    """:func:`import_object` for a callable; one line ``error("{what} 'spec': reason")``."""
    try:
        obj = import_object(spec)
    except ValueError as exc:
        raise error(f"{what} {spec!r}: {exc}") from None
    if not callable(obj):
        raise error(f"{what} {spec!r}: {spec} is not callable")
    return obj


def _load_file(path: str):
    import importlib.util
    import sys
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    found = next((p for p in (Path(path), checkout / path) if p.is_file()), None)
    if found is None:
        raise ValueError(f"no file {path!r} (looked in . and {checkout})")
    spec = importlib.util.spec_from_file_location(f"rlpost_user_{found.stem}", found)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its classes' source is found, its functions pickle
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error it raises is its own, said in one line
        raise ValueError(f"{path} does not load ({type(exc).__name__}: {exc})") from None
    return module
